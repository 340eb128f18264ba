"""Colossal-AI's arguments as data: each one's default, what it becomes in meshlab, and
what a value meshlab does not implement gets.

Every argument of every plugin (and of the Booster's methods) is one ``Arg``:

* ``maps`` — translated into a transform, a mesh axis, an optimizer or booster setting;
  ``probe`` is a valid non-default value, so a test can see that it changes something;
* ``default`` — only the default value is meshlab's behaviour; any other value raises
  ``UnsupportedArgument`` naming the meshlab equivalent;
* ``no_effect`` — a scheduling or memory hint that cannot change a result (bucket sizes,
  overlap switches); any value is accepted, and a non-default one warns once
  (``NoEffectWarning``) saying what meshlab does instead — never silently.

The documented mapping table (``docs/booster.md``) is generated from these lists.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

from ..core.errors import ConfigError, ConfigTypeError

REQUIRED = inspect.Parameter.empty


class UnsupportedArgument(ConfigError):
    """A Colossal-AI argument whose value meshlab does not implement. ``owner`` is the
    plugin or method, ``argument`` the name, ``equivalent`` what to use in meshlab."""

    def __init__(self, owner: str, argument: str, value: Any, why: str, equivalent: str):
        self.owner, self.argument, self.value, self.equivalent = owner, argument, value, equivalent
        super().__init__(f"{owner}({argument}={value!r}): {why}. meshlab's equivalent: "
                         f"{equivalent}")


class NoEffectWarning(UserWarning):
    """A Colossal-AI tuning argument that cannot change a result in meshlab was given a
    non-default value; the message says what meshlab does instead."""


@dataclasses.dataclass(frozen=True)
class With:
    """A probe value that needs companions (``sp_size=2`` needs the sequence mode); a
    callable ``value`` is called for it (torch's FSDP configuration objects)."""

    value: Any
    also: tuple = ()

    def kwargs(self, name: str) -> dict:
        v = self.value() if callable(self.value) else self.value
        return {name: v, **dict(self.also)}


def probe_kwargs(arg: "Arg") -> dict:
    """The keyword arguments that give ``arg`` its probe value."""
    p = arg.probe if isinstance(arg.probe, With) else With(arg.probe)
    return p.kwargs(arg.name)


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    default: Any
    kind: str                 # "maps" | "default" | "no_effect"
    meshlab: str              # what it is in meshlab (the table's text)
    probe: Any = None         # a valid non-default value (maps, no_effect)
    refusal: str = ""         # default kind: why another value is refused

    def __post_init__(self):
        assert self.kind in ("maps", "default", "no_effect"), self.kind


def maps(name, default, meshlab, probe) -> Arg:
    return Arg(name, default, "maps", meshlab, probe)


def only(name, default, why, equivalent) -> Arg:
    """Only ``default`` is accepted; ``why`` another value is refused, ``equivalent``."""
    return Arg(name, default, "default", equivalent, refusal=why)


def hint(name, default, meshlab, probe) -> Arg:
    return Arg(name, default, "no_effect", meshlab, probe)


def is_default(arg: Arg, value) -> bool:
    """``value`` is the argument's default: the same object for None and flags, the same
    number for numbers (``2**16`` and ``65536.0`` alike), else equal and of one type."""
    d = arg.default
    if d is None or isinstance(d, bool) or isinstance(value, bool):
        return value is d
    if isinstance(d, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(d)
    try:
        return type(value) is type(d) and bool(value == d)
    except Exception:
        return False


def signature(args: tuple[Arg, ...], positional: int = 0) -> inspect.Signature:
    """The Python signature the arguments describe (the first ``positional`` may be
    passed by position, as Colossal-AI's required ``tp_size, pp_size`` are)."""
    params = []
    for i, a in enumerate(args):
        kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if i < positional
                else inspect.Parameter.KEYWORD_ONLY)
        params.append(inspect.Parameter(a.name, kind, default=a.default))
    return inspect.Signature(params)


def bind(owner: str, args: tuple[Arg, ...], positional: int, given_args: tuple,
         given: dict) -> dict:
    """The full argument values of a call, checked against ``args``: an unknown name is a
    ``ConfigTypeError`` naming the closest known one; a ``default`` argument given another
    value is an ``UnsupportedArgument``; a ``no_effect`` one warns."""
    import difflib

    sig = signature(args, positional)
    known = [a.name for a in args]
    for k in given:
        if k not in known:
            near = difflib.get_close_matches(k, known, n=1)
            hint_ = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigTypeError(f"{owner}: unknown argument {k!r}{hint_} (its arguments: "
                                  f"{', '.join(known)})")
    try:
        bound = sig.bind(*given_args, **given)
    except TypeError as e:
        raise ConfigTypeError(f"{owner}: {e}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    for a in args:
        v = values[a.name]
        if v is REQUIRED:
            raise ConfigTypeError(f"{owner}: {a.name} is required")
        if is_default(a, v):
            continue
        if a.kind == "default":
            raise UnsupportedArgument(owner, a.name, v, a.refusal, a.meshlab)
        _check_kind(owner, a, v)
        if a.kind == "no_effect":
            warnings.warn(f"{owner}({a.name}={v!r}) has no effect in meshlab: {a.meshlab}",
                          NoEffectWarning, stacklevel=4)
    return values


def _model_value(a: Arg):
    """A value of the kind ``a`` takes: its default, else its probe's."""
    if a.default is not None and a.default is not REQUIRED:
        return a.default
    p = a.probe.value if isinstance(a.probe, With) else a.probe
    return None if callable(p) else p


def _check_kind(owner: str, a: Arg, v) -> None:
    """A flag is a bool and a number is a finite real number (None where the default is
    None): 'dp' or NaN for a fraction, 1 for a flag, are refused by name here instead of
    failing (or being read as something else) where the argument is used."""
    import math
    import numbers

    model = _model_value(a)
    if v is None and a.default is None:
        return
    if isinstance(model, bool):
        if not isinstance(v, bool):
            raise ConfigTypeError(f"{owner}({a.name}={v!r}): a flag, True or False")
    elif isinstance(model, numbers.Real):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ConfigTypeError(f"{owner}({a.name}={v!r}): a finite number, e.g. "
                                  f"{a.name}={model!r}")


def table_rows(args: tuple[Arg, ...]) -> list[tuple[str, str, str, str]]:
    """(argument, default, kind, meshlab) for the documentation table."""
    kinds = {"maps": "implemented", "default": "default only; other values refused",
             "no_effect": "accepted, no effect (warns)"}
    out = []
    for a in args:
        d = "(required)" if a.default is REQUIRED else repr(a.default)
        text = a.meshlab if a.kind != "default" else f"{a.refusal}; use {a.meshlab}"
        out.append((a.name, d, kinds[a.kind], text))
    return out
