"""fuse: run a Hugging Face model's RMSNorm, rotary embedding, attention and loss on
meshlab's fused ops (``meshlab.ops.hf``), routed at materialize time."""

from __future__ import annotations

import dataclasses

from .._errors import ConfigError
from .._plan import Plan
from ._base import Transform

FUSABLE = ("rms_norm", "rotary", "attention", "loss")


@dataclasses.dataclass(frozen=True)
class Fuse(Transform):
    """Route ``ops`` (any of ``rms_norm``, ``rotary``, ``attention``, ``loss``) to
    meshlab's custom ops without replacing any ``forward``; each routing is probed against
    the module it replaces when it is installed."""

    ops: tuple[str, ...] = FUSABLE

    def __post_init__(self):
        ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        bad = [o for o in ops if o not in FUSABLE]
        if bad or not ops or len(set(ops)) != len(ops):
            raise ConfigError(f"fuse{ops!r}: choose distinct ops from {FUSABLE}")
        object.__setattr__(self, "ops", ops)

    def apply(self, plan: Plan) -> Plan:
        return plan.with_option("fuse", {"ops": self.ops})

    def __repr__(self) -> str:
        return "fuse()" if self.ops == FUSABLE else f"fuse{self.ops!r}".replace(",)", ")")


def fuse(*ops: str) -> Fuse:
    """Fused ops for a Hugging Face model: ``fuse()`` routes all four, ``fuse('rms_norm',
    'loss')`` those named."""
    return Fuse(tuple(ops) or FUSABLE)
