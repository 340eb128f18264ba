"""remat: activation checkpointing of the repeated blocks."""

from __future__ import annotations

import dataclasses

from .._errors import ConfigError
from .._plan import Plan
from ._base import Transform

POLICIES = ("none", "full", "selective")


@dataclasses.dataclass(frozen=True)
class Remat(Transform):
    """Recompute activations in backward. ``full`` keeps only each block's input;
    ``selective`` also keeps matmul outputs (recomputes the cheap elementwise ops)."""

    policy: str = "full"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ConfigError(f"remat({self.policy!r}): choose one of {POLICIES}")

    def apply(self, plan: Plan) -> Plan:
        return plan.with_option("remat", {"policy": self.policy})

    def __repr__(self) -> str:
        return f"remat({self.policy!r})"


def remat(policy: str = "full") -> Remat:
    """Activation checkpointing for every repeated block (``'none'|'full'|'selective'``)."""
    return Remat(policy)
