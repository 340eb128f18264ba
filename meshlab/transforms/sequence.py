"""sequence: shard activations along the sequence over a mesh axis.

* ``split_gather``: Megatron sequence parallelism inside tensor parallelism — the axis
  must be the tensor-parallel one; the blocks' outputs are sequence-sharded between the
  TP regions (the same as mapping the logical ``seq`` axis to it in Rules).
* ``all_to_all``: DeepSpeed-Ulysses — each rank keeps a slice of the sequence through the
  whole block stack; attention exchanges sequence for heads with an all-to-all before and
  after (the head count must divide over the axis).
* ``ring``: context parallelism — K/V blocks travel around the ring with online-softmax
  accumulation; the sequence is split in 2n chunks, rank r keeping chunks r and 2n-1-r so
  the causal work is balanced.

For ``all_to_all`` and ``ring`` the sequence is split before the first block and gathered
after the last, so the embeddings, final norm and head see the whole sequence. Causal
attention without padding masks.

Odd lengths are never padded silently: a sequence not divisible by the axis raises.
"""

from __future__ import annotations

import dataclasses

from .._errors import ConfigError
from .._plan import Plan
from .._rules import Rules
from ._base import Transform

MODES = ("split_gather", "all_to_all", "ring")


@dataclasses.dataclass(frozen=True)
class Sequence(Transform):
    axis: str = "sp"
    mode: str = "all_to_all"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"sequence(mode={self.mode!r}): one of {MODES}")

    def apply(self, plan: Plan) -> Plan:
        if self.mode == "split_gather":
            rules = Rules(seq=self.axis)
            return plan.replace(rules=rules if plan.rules is None else plan.rules | rules)
        if not plan.model.blocks:
            raise ConfigError(f"sequence({self.mode}) needs a model with repeated blocks")
        return plan.with_option("sequence", {"axis": self.axis, "mode": self.mode})

    def __repr__(self) -> str:
        return f"sequence({self.axis!r}, mode={self.mode!r})"


def sequence(axis: str = "sp", mode: str = "all_to_all") -> Sequence:
    """Sequence parallelism over ``axis`` (``'split_gather'`` or ``'all_to_all'``).

    >>> sequence('sp', 'all_to_all')
    sequence('sp', mode='all_to_all')
    """
    return Sequence(axis, mode)
