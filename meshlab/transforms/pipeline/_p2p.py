"""The pipeline's share of ``plan.comm()``, and which blocks each pipeline rank runs.

Per step, every one of the ``m`` microbatches crosses each stage boundary whose two
stages sit on different ranks (``torch.distributed.pipelining``'s forward and backward
send ops): the rank of the earlier stage sends the microbatch's hidden states forward and
receives their gradient in backward, the rank of the later stage receives them and sends
the gradient back. Adjacent stages on one rank (the turn of ZB-V's V) hand the tensors
over by a call, without communication. A rank with stages on ``k`` such boundaries sends
``k m`` and receives ``k m`` tensors per step, each of a microbatch's tokens x hidden in
the dtype of the residual stream between blocks: the parameters' dtype (``precision``'s
autocast runs the matmuls in its compute dtype, but the residual additions come back to
the parameters' dtype, which is what the stages exchange). Plus one all-reduce of the
step's loss (8 bytes) over the pipeline axis (only the last stage holds it).

The rank counted by default (no ``coord``, or one without the pipeline axis) is the
busiest: the most blocks, then the most boundaries, then the most parameter bytes.
"""

from __future__ import annotations

import math

from ...core.units import dtype_bytes
from ...planning.plan import Plan
from .._protocol import CommOp
from ._schedule import boundaries, stages


def busiest_rank(plan: Plan, opt) -> int:
    """The pipeline rank with the most blocks, then the most stage boundaries, then the
    most parameter bytes (one rank's shards); the lowest of equals."""
    st = stages(plan, opt)
    ranks = sorted({s.rank for s in st})

    def load(r: int):
        mine = [s for s in st if s.rank == r]
        return (sum(len(s.blocks) for s in mine), boundaries(st, r),
                sum(s.rank_bytes for s in mine), -r)

    return max(ranks, key=load)


def rank_at(plan: Plan, opt, coord) -> int:
    """The pipeline coordinate of ``coord``, or the busiest rank without one."""
    if coord and opt.axis in coord:
        return coord[opt.axis]
    return busiest_rank(plan, opt)


def rank_blocks(plan: Plan, opt, coord) -> tuple[str, ...]:
    """The blocks of the stages the pipeline rank at ``coord`` runs, in model order."""
    r = rank_at(plan, opt, coord)
    return tuple(b for s in stages(plan, opt) if s.rank == r for b in s.blocks)


def hidden_size(plan: Plan) -> int | None:
    """The width of the hidden states between blocks: the config's, else a traced block
    output's last dim, else the embedding's."""
    cfg = plan.model.config_get
    h = cfg("hidden_size") or cfg("n_embd") or cfg("d_model")
    if h:
        return int(h)
    blocks = set(plan.model.blocks)
    for a in plan.activations:
        if a.module in blocks and a.shape:
            return int(a.shape[-1])
    emb = next((e for e in plan.params if len(e.shape) == 2 and not e.fqn.startswith(
        tuple(b + "." for b in blocks)) and ("embed" in e.fqn or "wte" in e.fqn)), None)
    return emb.shape[-1] if emb is not None else None


def stream_dtype(plan: Plan, blocks: tuple[str, ...]) -> str:
    """The dtype of the residual stream: that of the (first) block's parameters."""
    first = tuple(b + "." for b in blocks[:1])
    e = next((e for e in plan.params if e.fqn.startswith(first)), None) or plan.params[0]
    return e.dtype


def p2p_comm(plan: Plan, opt, batch, seq, coord) -> list[CommOp]:
    """The sends and receives of the pipeline rank at ``coord`` per step (module
    docstring), and the loss's all-reduce over the pipeline axis."""
    ops = [CommOp("all_reduce", opt.axis, 1, 8)]
    h = hidden_size(plan)
    if batch is None or seq is None or h is None:
        return ops
    st = stages(plan, opt)
    n = boundaries(st, rank_at(plan, opt, coord)) * opt.microbatches
    if n == 0:
        return ops
    from ._stage import seq_split

    # one microbatch's tokens, of which a rank holds 1/seq_split between the blocks under
    # sequence parallelism (the first block cuts the sequence, the last joins it)
    tokens = math.ceil(batch * seq / opt.microbatches / seq_split(plan))
    one = tokens * h * dtype_bytes(stream_dtype(plan, plan.model.blocks))
    return ops + [CommOp("send", opt.axis, n, n * one), CommOp("recv", opt.axis, n, n * one)]

