"""Typed errors. Every message names the thing, states the rule and offers the fix."""

from __future__ import annotations


class MeshlabError(Exception):
    """Base class of every error meshlab raises on purpose."""


class SpecError(MeshlabError, ValueError):
    """A PartitionSpec is malformed or does not fit the tensor or mesh it is applied to."""


class MeshError(MeshlabError, ValueError):
    """A mesh description is malformed or does not match the processes that were started."""


class RulesError(MeshlabError, ValueError):
    """Logical-axis rules are malformed or two rule sets disagree."""


class PlanError(MeshlabError, ValueError):
    """A plan cannot be built, bound or composed (glob matching nothing, conflicting transforms)."""


class PolicyError(MeshlabError, LookupError):
    """No sharding policy exists for a model, or a policy does not fit it."""


class ConfigError(MeshlabError, ValueError):
    """A transform or training option was given a value it does not accept."""


class NotRunnable(ConfigError):
    """A layout a plan may describe (JAX shards any array this way) that ``parallelize``
    cannot run. ``bind`` records it in ``plan.not_runnable`` and the plan's table shows it;
    ``parallelize`` raises it before any collective."""


class RankMismatchError(MeshlabError, RuntimeError):
    """The ranks of one job disagree on what they run (spec, mesh, model, batch shape, or
    which collective call they are in); raised on every rank before any collective."""


class PeerError(MeshlabError, RuntimeError):
    """Another rank failed before a collective section; every rank raises instead of
    waiting for it."""


class BatchError(ConfigError):
    """A batch holds a value the model cannot read: a token id or label outside the
    vocabulary. One process raises ``IndexError`` there, while a vocabulary-split embedding
    or loss would mask it silently; meshlab checks every forward and raises this on every
    rank before the forward's first collective."""


class NonFiniteError(MeshlabError, FloatingPointError):
    """The global gradient norm of a step is NaN or infinite (``meshlab.optimizer(...,
    nonfinite='raise')``); raised on every rank, since every rank sees the same norm."""


class ConfigTypeError(ConfigError, TypeError):
    """An argument of the wrong type (a dict where a transform belongs, a string where a
    function belongs); a ``ConfigError`` and a ``TypeError`` alike."""


class RulesTypeError(RulesError, TypeError):
    """A value of the wrong type composed with ``Rules`` (``Rules(...) | {'mlp': 'tp'}``);
    a ``RulesError`` and a ``TypeError`` alike."""


# -- argument checks ---------------------------------------------------------------------
# Each public function checks its arguments where they enter, with these: one rule each,
# raising the caller's error type with the call, the value, the rule and the fix, so a bad
# value fails at the call that gave it rather than later, inside a collective or a kernel.

def check_int(value, call: str, arg: str, *, low: int = 1, high: int | None = None,
              error: type = ConfigError, example: int | None = None) -> int:
    """``value`` as an ``int`` in ``[low, high]``. Bools and floats are refused (``True``
    would pass as 1 and ``2.5`` silently floor): a count is a whole number."""
    import operator

    ok = not isinstance(value, bool)
    try:
        n = operator.index(value) if ok else 0      # ints, numpy integers
    except TypeError:
        ok = False
    if ok and n >= low and (high is None or n <= high):
        return int(n)
    span = f">= {low}" if high is None else f"from {low} to {high}"
    kind = "" if ok else f" (got {type(value).__name__}; bools and floats are refused)"
    eg = example if example is not None else max(low, 1) if high is None else high
    raise error(f"{call}({arg}={value!r}): {arg} must be an integer {span}{kind}; pass e.g. "
                f"{arg}={eg}")


def check_number(value, call: str, arg: str, *, error: type = ConfigError,
                 example: float = 1.0, allow_zero: bool = False) -> float:
    """``value`` as a finite ``float`` > 0 (>= 0 with ``allow_zero``); bools, strings, NaN
    and infinities are refused."""
    import math

    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        try:
            import numpy as np
            ok = isinstance(value, (np.integer, np.floating))
        except ImportError:      # pragma: no cover - numpy ships with torch
            pass
    x = float(value) if ok else math.nan
    if ok and math.isfinite(x) and (x > 0 or (allow_zero and x == 0)):
        return x
    rule = "a finite number >= 0" if allow_zero else "a finite number > 0"
    raise error(f"{call}({arg}={value!r}): {arg} must be {rule} (not a bool, string, NaN or "
                f"infinity); pass e.g. {arg}={example!r}")


def check_bool(value, call: str, arg: str, *, error: type = ConfigError) -> bool:
    """``value`` as a ``bool``; ``1`` or ``'yes'`` are refused (a flag is True or False)."""
    if isinstance(value, bool):
        return value
    raise error(f"{call}({arg}={value!r}): {arg} must be True or False, got "
                f"{type(value).__name__}")


def check_choice(value, call: str, arg: str, choices, *, error: type = ConfigError) -> str:
    """``value`` as one of the strings ``choices``; anything else lists them."""
    if isinstance(value, str) and value in choices:
        return value
    allowed = ", ".join(repr(c) for c in choices)
    raise error(f"{call}({arg}={value!r}): {arg} must be one of {allowed}")


def check_name(value, call: str, arg: str, *, error: type = ConfigError,
               example: str = "dp") -> str:
    """``value`` as an axis name: a string that is a Python identifier (``'dp'``)."""
    if isinstance(value, str) and value.isidentifier():
        return value
    raise error(f"{call}({arg}={value!r}): {arg} must be a mesh axis name, a string such "
                f"as {example!r}")


def check_names(value, call: str, arg: str, *, error: type = ConfigError,
                example: str = "dp") -> tuple[str, ...]:
    """An axis name or a non-empty tuple (or list) of distinct axis names, as a tuple."""
    names = (value,) if isinstance(value, str) else \
        tuple(value) if isinstance(value, (tuple, list)) else None
    if names and all(isinstance(n, str) and n.isidentifier() for n in names) \
            and len(set(names)) == len(names):
        return names
    raise error(f"{call}({arg}={value!r}): {arg} must be a mesh axis name or a tuple of "
                f"distinct ones, e.g. {arg}={example!r} or {arg}=({example!r}, 'fsdp')")
