"""pipeline: split the repeated blocks into stages over a mesh axis.

The plan only records the choice; ``stages(plan)`` (on a bound plan) assigns blocks to
stages and ranks and ``bubble(plan)`` gives the expected idle fraction:

* GPipe and 1F1B:           (p - 1) / (m + p - 1)
* interleaved 1F1B (v > 1): (p - 1) / (v m + p - 1)
* zero-bubble (ZB-H1 and ZB-V split backward into input and weight gradients, and
  fill the warm-up and cool-down with weight-gradient work): (p - 1) / (3 m + p - 1)

with p pipeline ranks, m microbatches and v stages per rank.
"""

from __future__ import annotations

import dataclasses
import math

from .._errors import ConfigError, PlanError
from .._plan import Plan, dtype_bytes
from ._base import Transform

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero_bubble": 2, "zbv": 2}


@dataclasses.dataclass(frozen=True)
class Pipeline(Transform):
    """Pipeline parallelism over ``axis`` with ``schedule`` and ``microbatches``."""

    axis: str = "pp"
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int | None = None
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline(schedule={self.schedule!r}): one of {sorted(SCHEDULES)}")
        if self.microbatches < 1:
            raise ConfigError(f"pipeline(microbatches={self.microbatches}): at least 1")
        v = self.v
        if self.schedule in ("gpipe", "1f1b") and v != 1:
            raise ConfigError(f"{self.schedule} runs one stage per rank; use "
                              f"schedule='interleaved' for virtual_stages={v}")
        if self.schedule == "zbv" and v != 2:
            raise ConfigError("zbv runs exactly two stages per rank (a V shape)")

    @property
    def v(self) -> int:
        return self.virtual_stages or SCHEDULES[self.schedule]

    def apply(self, plan: Plan) -> Plan:
        if not plan.model.blocks:
            raise PlanError(f"pipeline: {plan.model.cls or 'the model'} has no repeated blocks "
                            f"to split into stages")
        return plan.with_option("pipeline", {
            "axis": self.axis, "schedule": self.schedule, "microbatches": self.microbatches,
            "virtual_stages": self.v,
            "layers_per_stage": None if self.layers_per_stage is None else list(self.layers_per_stage)})

    def __repr__(self) -> str:
        return (f"pipeline({self.axis!r}, schedule={self.schedule!r}, "
                f"microbatches={self.microbatches}, virtual_stages={self.v})")


def pipeline(axis: str = "pp", *, schedule: str = "1f1b", microbatches: int = 4,
             virtual_stages: int | None = None,
             layers_per_stage: tuple[int, ...] | list[int] | None = None) -> Pipeline:
    """Split the model's blocks into pipeline stages over mesh axis ``axis``.

    >>> pipeline('pp', schedule='interleaved', microbatches=8)
    pipeline('pp', schedule='interleaved', microbatches=8, virtual_stages=2)
    """
    return Pipeline(axis, schedule, microbatches, virtual_stages,
                    None if layers_per_stage is None else tuple(layers_per_stage))


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int                 # pipeline stage (chunk) index
    rank: int                  # coordinate on the pipeline axis that runs it
    blocks: tuple[str, ...]
    first: bool
    last: bool
    param_bytes: int


def _rank_of(chunk: int, p: int, v: int, schedule: str) -> int:
    if schedule == "zbv":                        # V shape: 0..p-1 then p-1..0
        return chunk if chunk < p else 2 * p - 1 - chunk
    return chunk % p


def stages(plan: Plan) -> list[Stage]:
    """The stages of a bound plan with a pipeline: blocks balanced by parameter bytes."""
    opt = plan.option("pipeline")
    if opt is None:
        return []
    p = plan.mesh_shape.get(opt["axis"])
    if p is None:
        raise ConfigError(f"pipeline axis {opt['axis']!r} is not a mesh axis "
                          f"{tuple(plan.mesh_shape)}")
    v = opt["virtual_stages"]
    n = p * v
    blocks = plan.model.blocks
    if len(blocks) < n:
        raise ConfigError(f"pipeline: {len(blocks)} blocks cannot fill {n} stages "
                          f"({p} ranks x {v}); use fewer stages")
    size = {b: 0 for b in blocks}
    outside = [0, 0]
    for e in plan.params:
        if e.tied_to:
            continue
        nb = e.numel * dtype_bytes(e.dtype)
        owner = next((b for b in blocks if e.fqn.startswith(b + ".")), None)
        if owner is not None:
            size[owner] += nb
        else:
            outside["embed" not in e.fqn and "wte" not in e.fqn] += nb
    if opt["layers_per_stage"] is not None:
        counts = list(opt["layers_per_stage"])
        if len(counts) != n or sum(counts) != len(blocks) or min(counts) < 1:
            raise ConfigError(f"layers_per_stage={counts}: give {n} positive counts summing to "
                              f"{len(blocks)}")
    else:
        counts = _balanced([size[b] for b in blocks], n, outside[0], outside[1])
    out, start = [], 0
    for i, c in enumerate(counts):
        bl = tuple(blocks[start:start + c])
        start += c
        nb = sum(size[b] for b in bl) + (outside[0] if i == 0 else 0) + \
            (outside[1] if i == n - 1 else 0)
        out.append(Stage(i, _rank_of(i, p, v, opt["schedule"]), bl, i == 0, i == n - 1, nb))
    return out


def _balanced(weights: list[int], n: int, head: int, tail: int) -> list[int]:
    """Contiguous split of ``weights`` into ``n`` non-empty parts minimizing the heaviest
    part, with ``head`` added to the first part and ``tail`` to the last (binary search on
    the capacity, greedy packing)."""

    def pack(cap: int) -> list[int] | None:
        counts, acc, cnt = [], head, 0
        for i, w in enumerate(weights):
            left = len(weights) - i                 # blocks still to place, this one included
            need = n - len(counts) - 1               # stages still to open after this one
            if cnt and (acc + w > cap or left <= need):
                counts.append(cnt)
                acc, cnt = 0, 0
            acc += w
            cnt += 1
        counts.append(cnt)
        if len(counts) != n or acc + tail > cap:
            return None
        return counts

    lo, hi = max(weights), sum(weights) + head + tail
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = pack(mid)
        if got is not None:
            best, hi = got, mid - 1
        else:
            lo = mid + 1
    if best is None:   # cannot happen with len(weights) >= n: one block per stage fits hi
        raise ConfigError(f"pipeline: cannot split {len(weights)} blocks into {n} stages")
    return best


def bubble(plan: Plan) -> float:
    """Expected idle fraction of the pipeline schedule (module docstring)."""
    opt = plan.option("pipeline")
    if opt is None:
        return 0.0
    p, m, v = plan.mesh_shape[opt["axis"]], opt["microbatches"], opt["virtual_stages"]
    if opt["schedule"] in ("zero_bubble", "zbv"):
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)
