"""zero_shard and data_parallel: what is split or replicated over the data-parallel axis."""

from __future__ import annotations

import dataclasses

from .._errors import ConfigError
from .._plan import Plan
from ._base import Transform


def _axes(axis) -> tuple[str, ...]:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes or not all(isinstance(a, str) and a.isidentifier() for a in axes):
        raise ConfigError(f"axis must be a mesh axis name or a tuple of them, got {axis!r}")
    return axes


@dataclasses.dataclass(frozen=True)
class ZeroShard(Transform):
    """ZeRO over ``axis``: stage 1 shards optimizer state, 2 also gradients, 3 also
    parameters. Stages 2 and 3 run on FSDP2 ``fully_shard``; stage 1 is meshlab's own
    sharded optimizer. Stage 0 is plain data parallelism (gradients all-reduced)."""

    stage: int
    axis: tuple[str, ...] = ("dp",)

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_shard(stage={self.stage!r}): stage must be 0, 1, 2 or 3")

    def apply(self, plan: Plan) -> Plan:
        prev = plan.option("zero")
        if prev is not None and (prev["stage"], tuple(prev["axis"])) != (self.stage, self.axis):
            raise ConfigError(
                f"{self!r} conflicts with an earlier zero_shard(stage={prev['stage']}, "
                f"axis={tuple(prev['axis'])!r}); keep one"
            )
        return plan.with_option("zero", {"stage": self.stage, "axis": list(self.axis)})

    def __repr__(self) -> str:
        a = self.axis[0] if len(self.axis) == 1 else self.axis
        return f"zero_shard(stage={self.stage}, axis={a!r})"


def zero_shard(stage: int = 3, axis: str | tuple[str, ...] = "dp") -> ZeroShard:
    """Shard optimizer state (1), + gradients (2), + parameters (3) over ``axis``.

    >>> zero_shard(3, 'dp')
    zero_shard(stage=3, axis='dp')
    """
    return ZeroShard(stage=stage, axis=_axes(axis))


def data_parallel(axis: str | tuple[str, ...] = "dp") -> ZeroShard:
    """Plain data parallelism over ``axis`` (``zero_shard(0, axis)``): replicated
    parameters, gradients all-reduced once per step."""
    return ZeroShard(stage=0, axis=_axes(axis))
