"""Tensor parallelism's share of ``plan.comm()``: the activation collectives of the rank.

Per microbatch, with T its tokens, h the hidden size, 4-byte activations and L the blocks
the rank runs (``plan.local_blocks``: all of them, or a pipeline rank's stages):

* without SP: 2L all-reduces of T·h in forward (row-parallel outputs) and 2L in backward
  (region entries), plus the embedding's forward all-reduce where the rank runs the first
  block and the LM head input's backward all-reduce and the vocab-parallel loss's 3
  all-reduces of T' scalars (max, sum-exp, target logit) where it runs the last;
* with SP: per block 2 all-gathers and 2 reduce-scatters of T·h each way; the sequence
  is gathered after the blocks (forward, on the last block's rank) and before them
  (backward, on the first's).

A pipeline runs each of its ``m`` microbatches through the blocks on its own: ``m`` times
the collectives, each of a microbatch's tokens.
"""

from __future__ import annotations

import math

from ...core.errors import PlanError
from ...planning.plan import Plan
from .._protocol import CommOp
from ._layout import sequence_parallel


def microbatches(plan: Plan) -> int:
    """How many microbatches run the blocks separately per step (a pipeline's), else 1."""
    return next((t.microbatches for t in plan.rooms if getattr(t, "kind", "") == "pipeline"),
                1)


def tp_comm(plan: Plan, batch, seq, coord) -> list[CommOp]:
    """Activation traffic of tensor parallelism for the rank at ``coord`` (module
    docstring); gradient sums over tp are ``Shard.reductions`` (``_gradsync``)."""
    axis = plan.roles.tp
    if axis is None or batch is None or seq is None:
        return []
    blocks = plan.model.blocks
    mine = plan.local_blocks(coord)
    first = int(not blocks or blocks[0] in mine)
    last = int(not blocks or blocks[-1] in mine)
    m = microbatches(plan)
    h = plan.model.config_get("hidden_size") or plan.model.config_get("n_embd")
    if h is None:
        raise PlanError(f"shard's traffic on {plan.model.cls}: the hidden size is neither in "
                        f"the model's config nor measured; count it with plan.comm(batch=, "
                        f"seq=, inputs=...), which measures it from an example input")
    L, act = len(mine), math.ceil(batch * seq / m) * h * 4
    if sequence_parallel(plan, axis):
        per = [("all_gather", 4 * L + first + last), ("reduce_scatter", 4 * L),
               ("all_reduce", first + last)]
    else:
        per = [("all_reduce", 4 * L + first + last)]
    ops = [CommOp(kind, axis, m * n, m * n * act) for kind, n in per if n]
    if last:                                     # the vocab-parallel loss, per microbatch
        ops.append(CommOp("all_reduce", axis, 3 * m, 3 * m * math.ceil(batch * (seq - 1) / m)
                          * 4))
    return ops
