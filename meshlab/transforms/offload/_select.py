"""Which tensors ``offload`` keeps in host memory: a pure function of the plan.

Fractions are of the trainable bytes on each rank. Parameters go to the host by FSDP2
unit (the repeated blocks, then the rest of the model: FSDP2 keeps a unit's shards on
the host or on the device), largest first; gradients and optimizer state by tensor,
largest first, starting with what an earlier kind already put there. So the sets nest:
an offloaded parameter's gradient and optimizer state are on the host, and an offloaded
gradient's optimizer state is. Each fraction is reached or passed by the last tensor (or
unit) taken.

``policy='auto'`` chooses the smallest fractions, optimizer state first, then gradients,
then parameters, whose device bytes (``plan.memory()``'s rows) fit ``budget``.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ...core.units import dtype_bytes
from ...core.errors import ConfigError
from ...core.placement import local_shape
from ...planning.decisions import register_decision
from ..zero._install import HostUnits

_STEPS = 20           # auto tries fractions in steps of 1/20


class OffloadBudgetError(ConfigError):
    """``offload(policy='auto', budget=...)``: the model does not fit the budget even with
    everything offload may move to the host."""


@dataclasses.dataclass(frozen=True)
class Choice(HostUnits):
    """The resolved selection: FQNs per kind and the fractions they reach. ``offload``
    decides it once, in ``bind``; the bound plan records it (``plan.decision(Choice)``)."""

    fractions: tuple[float, float, float]         # requested (or chosen) params, grads, optimizer
    params: frozenset[str]
    grads: frozenset[str]
    optimizer: frozenset[str]
    units: tuple[str, ...]                        # FSDP2 units whose shards stay on the host
    reached: tuple[float, float, float]           # the byte fractions actually taken
    auto: str = ""                                # what 'auto' chose and why

    def describe(self) -> str:
        kinds = ("params", "grads", "optimizer")
        got = ", ".join(f"{k}={f:.2f}" for k, f in zip(kinds, self.reached))
        return f"offload: {got} of the trainable bytes in host memory" + (
            f" ({self.auto})" if self.auto else "")

    def to_json(self) -> dict:
        return {"fractions": list(self.fractions), "params": sorted(self.params),
                "grads": sorted(self.grads), "optimizer": sorted(self.optimizer),
                "units": list(self.units), "reached": list(self.reached), "auto": self.auto}

    @classmethod
    def from_json(cls, d: dict) -> "Choice":
        return cls(tuple(d["fractions"]), frozenset(d["params"]), frozenset(d["grads"]),
                   frozenset(d["optimizer"]), tuple(d["units"]), tuple(d["reached"]),
                   d["auto"])


register_decision("offload.choice", Choice)


def parse_bytes(value, what: str = "offload(budget=...)") -> int:
    """``'120GiB'``, ``'80GB'``, ``'512MiB'`` or an int of bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: {value!r} is not a size; write e.g. '120GiB' or 120 * 2**30")
    if isinstance(value, int) and value > 0:
        return value
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) \
        else None
    if m is None or m.group(2).lower() not in units or float(m.group(1)) <= 0:
        raise ConfigError(f"{what}: {value!r} is not a size; write e.g. '120GiB', '80GB' or "
                          f"a positive number of bytes")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def _tensors(plan) -> list[tuple[str, int]]:
    """(fqn, local bytes) of every trainable parameter, registration order."""
    sizes = plan.mesh_shape
    return [(e.fqn, math.prod(local_shape(e.shape, e.mesh_spec, sizes)) * dtype_bytes(e.dtype))
            for e in plan.params if e.requires_grad and e.tied_to is None]


def units(plan) -> dict[str, list[str]]:
    """FSDP2's units: each block FQN -> its trainable parameters; ``''`` -> the rest."""
    blocks = sorted(plan.model.blocks, key=len, reverse=True)
    out: dict[str, list[str]] = {b: [] for b in plan.model.blocks}
    out[""] = []
    for fqn, _ in _tensors(plan):
        owner = next((b for b in blocks if fqn.startswith(b + ".")), "")
        out[owner].append(fqn)
    return {u: names for u, names in out.items() if names}


def _take(ranked: list[tuple[str, int]], start: set[str], frac: float, total: int) -> set[str]:
    """``start`` plus tensors in ``ranked`` order until ``frac`` of ``total`` is reached."""
    have = set(start)
    got = sum(b for n, b in ranked if n in have)
    for n, b in ranked:
        if got >= frac * total - 1e-9 * total:
            break
        if n not in have:
            have.add(n)
            got += b
    return have


def choose(plan, fractions: tuple[float, float, float], *, zero_stage: int | None,
           late: frozenset = frozenset()) -> Choice:
    """The static selection for ``(params, grads, optimizer)`` fractions. ``late`` names
    the parameters whose gradients are summed after the backward (over a sequence or
    tensor-parallel axis: ``GradSync``'s reductions): those stay on the device until the
    step, which copies them out once summed, so the gradients taken in the backward are
    the others'."""
    fp, fg, fo = fractions
    tensors = _tensors(plan)
    nbytes = dict(tensors)
    total = sum(nbytes.values())
    by_size = sorted(tensors, key=lambda t: -t[1])        # stable: ties in registration order
    chosen_units: list[str] = []
    params: set[str] = set()
    if fp > 0:
        per_unit = sorted(units(plan).items(), key=lambda u: -sum(nbytes[n] for n in u[1]))
        got = 0
        for u, names in per_unit:
            if got >= fp * total - 1e-9 * total:
                break
            chosen_units.append(u)
            params.update(names)
            got += sum(nbytes[n] for n in names)
    early = [t for t in by_size if t[0] not in late]
    grads = _take(early, params, fg, total) if fg > 0 or params else set(params)
    opt = _take(by_size, grads, fo, total) if fo > 0 or grads else set(grads)

    def frac(names):
        return sum(nbytes[n] for n in names) / total if total else 0.0

    return Choice(fractions, frozenset(params), frozenset(grads), frozenset(opt),
                  tuple(chosen_units), (frac(params), frac(grads), frac(opt)))


def auto_fractions(plan, budget: int, device_bytes, *, can_grads: bool, can_params: bool
                   ) -> tuple[tuple[float, float, float], str]:
    """The smallest fractions (optimizer, then gradients, then parameters) whose device
    bytes (``device_bytes(fractions)``) fit ``budget``; ``OffloadBudgetError`` naming the
    smallest budget that works when none does."""
    from ...core.units import fmt_bytes

    ladder = [(0.0, 0.0, k / _STEPS) for k in range(_STEPS + 1)]
    if can_grads:
        ladder += [(0.0, k / _STEPS, 1.0) for k in range(1, _STEPS + 1)]
    if can_params:
        ladder += [(k / _STEPS, 1.0, 1.0) for k in range(1, _STEPS + 1)]
    need = None
    for fr in ladder:
        need = device_bytes(fr)
        if need <= budget:
            what = ("nothing offloaded" if fr == (0.0, 0.0, 0.0) else
                    "params={:.2f}, grads={:.2f}, optimizer={:.2f}".format(*fr))
            return fr, (f"auto: {what} fits {fmt_bytes(budget)} with "
                        f"{fmt_bytes(need)} of parameters, gradients and optimizer state")
    most = "params=1, grads=1, optimizer=1" if can_params else (
        "grads=1, optimizer=1" if can_grads else "optimizer=1")
    hint = "" if can_params else (
        "; under zero_shard(3) parameters can leave the device too" if can_grads else
        "; under zero_shard(2|3) or on one data rank gradients can leave the device too")
    raise OffloadBudgetError(
        f"offload(policy='auto', budget={fmt_bytes(budget)}): even with {most} the "
        f"parameters, gradients and optimizer state need {fmt_bytes(need)} of device memory "
        f"per rank; the smallest budget that works is {fmt_bytes(need)}. Raise the budget, "
        f"add ranks, or shard the model further{hint}")
