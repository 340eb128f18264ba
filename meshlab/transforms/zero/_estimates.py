"""``zero_shard``'s share of ``plan.memory()`` and ``plan.comm()``.

Memory: from stage 2 on, parameters, gradients and AdamW's moments are split over the
ZeRO axes (FSDP2 keeps them sharded at rest; ``ceil(local_0 / n) * rest`` per rank, as
FSDP2 pads dim 0); stage 1 keeps parameters and gradients whole and updates an fp32
master slice (its moments, the slice and its reduced gradient, fp32, split). Layouts
whose specs already shard over the data axis (FSDP by spec) are counted by the specs.

Traffic, with Ψ the bytes of this rank's (TP-local) gradients: stage 0 the backward's
bucketed all-reduces of Ψ (counted by ``_gradsync.estimate``; where FSDP2 runs it,
parameters resting on the host, its all-reduce of each unit's gradient); stage 1 a
reduce-scatter and an all-gather of Ψ (where FSDP2 runs it, the units' all-reduces and the
all-gather); stage 2 an all-gather in forward and
a reduce-scatter in backward per FSDP unit; stage 3 also the backward all-gather. Plus
one all-reduce of the step's loss (8 bytes) over every data axis.

Hybrid sharding (``replicate``): the state is split over the shard axes only, so memory
is the same as ``zero_shard`` over those alone; traffic adds, over the replicate axes,
FSDP2's all-reduce of each unit's reduce-scattered gradient shard (stages 2, 3) or the
backward's bucketed all-reduces of Ψ (stage 1, ``ZeroShard.reductions``, counted by
``meshlab.estimate.comm.grad_sync_ops``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

from ...core.names import ancestors
from ...core.placement import local_shape
from ...planning.plan import KEEP_WHOLE, Plan, dtype_bytes
from .._protocol import CommOp
from ..precision import Precision


def _split(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    if not shape or n == 1:
        return shape
    return (-(-shape[0] // n),) + tuple(shape[1:])


def _units(blocks: tuple[str, ...]):
    """``fqn -> `` the FSDP unit it belongs to: the first of ``blocks`` it lies under, else
    ``''`` (the root); looked up by its ancestors, not by scanning every block."""
    index: dict[str, int] = {}
    for i, b in enumerate(blocks):
        index.setdefault(b, i)

    def unit(fqn: str) -> str:
        under = [a for a in ancestors(fqn) if a in index]
        return min(under, key=index.__getitem__) if under else ""

    return unit


def _split_row(r, n: int, category: str | None = None, dtype: str | None = None):
    """Row ``r`` split over ``n`` ranks (FSDP2's padded dim 0), in ``dtype`` and filed
    under ``category`` where given."""
    try:
        return _split_row_kept(r, n, category, dtype)
    except TypeError:                # a row of a room's own that cannot be hashed
        return _split_row_kept.__wrapped__(r, n, category, dtype)


# Keyed on the row (a frozen MemRow, hashed by value), the ZeRO degree and what changes:
# every layout that splits the same parameter over as many ranks makes this same row.
@functools.lru_cache(maxsize=1 << 16)
def _split_row_kept(r, n: int, category: str | None, dtype: str | None):
    changes = {k: v for k, v in (("category", category), ("dtype", dtype)) if v is not None}
    return dataclasses.replace(r, shape=_split(r.shape, n), **changes)


def zero_memory(t, plan: Plan, rows: list) -> list:
    if plan.roles.fsdp:
        return rows                    # the specs split what FSDP splits
    n = math.prod(plan.mesh_shape[a] for a in t.axis)
    if t.stage >= 2:          # FSDP2 shards every parameter but those kept whole
        whole = {e.fqn for e in plan.params if KEEP_WHOLE in e.tags}
        return [r if r.fqn in whole else _split_row(r, n) for r in rows]
    if t.stage == 0 or n == 1:         # ZeRO-1 over one rank keeps no slices
        return rows
    out = []
    for r in rows:
        if r.category == "optimizer":        # the moments of the fp32 slice
            out.append(_split_row(r, n, dtype="float32"))
        elif r.category == "grads":          # the gradient, and the slice's reduced one
            out += [r, _split_row(r, n, dtype="float32")]
        else:
            out.append(r)
    masters = [_split_row(r, n, category="optimizer", dtype="float32")
               for r in rows if r.category == "grads"]
    return out + masters


def zero_comm(t, plan: Plan, coord) -> list[CommOp]:
    sizes = plan.mesh_shape
    dp = math.prod(sizes[a] for a in t.axis)
    rep = math.prod(sizes[a] for a in t.replicate)
    if dp == 1 and rep == 1:
        return []
    name = "_".join(t.axis)
    prec = plan.get(Precision)
    grad_dt = prec.reduce if prec else None
    buckets: dict = defaultdict(int)      # (dtype, tp-sharded?) -> elements
    counts: dict = defaultdict(int)       # (dtype, tp-sharded?) -> parameters
    units: dict = defaultdict(int)        # FSDP unit -> padded elements
    whole: dict = defaultdict(int)        # FSDP unit -> elements
    width: dict = defaultdict(int)        # FSDP unit -> bytes of an element (its widest)
    from ...planning.rows import rank_params

    blocks = plan.model.blocks
    unit_of = _units(blocks)
    for e in rank_params(plan, coord):       # a pipeline rank: its stages' parameters
        if e.tied_to is not None or not e.requires_grad:
            continue
        ls = local_shape(e.shape, e.mesh_spec, sizes, coord)
        key = (grad_dt or e.dtype if t.stage < 2 else e.dtype, bool(e.mesh_spec.axes))
        buckets[key] += math.prod(ls)
        counts[key] += 1
        unit = unit_of(e.fqn)
        units[unit] += (-(-ls[0] // dp) * dp * math.prod(ls[1:])) if ls else 1
        whole[unit] += math.prod(ls)
        width[unit] = max(width[unit], dtype_bytes(e.dtype))
    fsdp = t.fsdp(plan)
    data = "_".join(t.claims(plan)["dp"])
    whole_units = fsdp and t.stage < 2      # FSDP2 over a size-1 shard dimension
    ops = _stage_ops(t.stage, name, dp, buckets, units, prec, counts,
                     t.resharded(blocks), whole_units, width) if dp > 1 else []
    # gradients travel in precision(reduce=...)'s dtype, else in the parameters' own
    gbytes = (lambda u: dtype_bytes(prec.reduce)) if prec else (lambda u: width[u])
    if rep > 1 and t.stage >= 2:      # HSDP: each unit's gradient shard over the replicas
        ops += [CommOp("all_reduce", "_".join(t.replicate), 1, n // dp * gbytes(u))
                for u, n in units.items()]
    if whole_units:         # each unit's whole gradient, over every data axis
        ops += [CommOp("all_reduce", data, 1, n * gbytes(u)) for u, n in whole.items()]
    if fsdp:                # FSDP2: which parameters some data rank had a gradient for
        ops.append(CommOp("all_reduce", data, 1, 4 * sum(counts.values())))
    from ._batchnorm import comm as batch_statistics
    return ops + batch_statistics(plan) + [CommOp("all_reduce", data, 1, 8)]  # + the loss


def _stage_ops(stage, name, dp, buckets, units, prec, counts, freed,
               whole_units: bool = False, width=None) -> list[CommOp]:
    """Stage 1: per bucket ((dtype, tp-sharded?) -> elements, the dtype the gradients'
    own), the gradients reduce-scattered (in precision's reduce dtype, else the masters')
    and the master slices gathered (float32, or the parameters' dtype where wider);
    stages 2 and 3: per FSDP unit, its parameters gathered and its gradient
    reduce-scattered, in precision's dtypes or else the parameters' own (``width``: a
    unit's bytes an element)."""
    if stage == 0:
        return []          # the backward's all-reduces: ``_gradsync.estimate``
    if stage == 1:
        ops = []
        for key, n in buckets.items():
            padded, own = -(-n // dp) * dp, dtype_bytes(key[0])
            master = 4 if prec is not None else max(4, own)
            if not whole_units:   # else FSDP2 averaged the gradients (``zero_comm``)
                # each rank's part ends with one count per parameter of the bucket
                ops.append(CommOp("reduce_scatter", name, 1, (padded + dp * counts[key]) *
                                  (dtype_bytes(prec.reduce) if prec is not None else master)))
            ops.append(CommOp("all_gather", name, 1, padded * master))
        return ops
    ops = []
    for unit, n in units.items():
        pbytes = dtype_bytes(prec.compute) if prec else width[unit]
        gbytes = dtype_bytes(prec.reduce) if prec else width[unit]
        ops += [CommOp("all_gather", name, 1, n * pbytes),
                CommOp("reduce_scatter", name, 1, n * gbytes)]
        if unit in freed:              # re-gathered for backward (the root too)
            ops.append(CommOp("all_gather", name, 1, n * pbytes))
    return ops


def zero_transients(t, plan: Plan) -> list:
    """What FSDP2 gathers at the peak, in buffers beside the shards counted in memory
    (at any world size): ZeRO-3 one unit in use and the next prefetched (the largest two),
    ZeRO-2 every unit (kept gathered from forward to backward); a unit's whole gradient
    before its reduce-scatter. Under a pipeline, the units of the busiest rank's stages
    (``rank_params``), the parameters outside the blocks counted as one unit (two stage
    roots where a rank runs both the first and the last stage). Layouts sharded by spec
    (FSDP by spec) and stage < 2 add nothing."""
    from ...planning.rows import ActRow, rank_params

    if t.stage < 2 or plan.roles.fsdp:
        return []
    prec = plan.get(Precision)
    sizes = plan.mesh_shape
    units: dict = defaultdict(int)
    unit_of = _units(plan.model.blocks)
    own = 1                  # the widest parameter's bytes: what FSDP2 gathers without precision
    for e in rank_params(plan):
        if e.tied_to is not None:
            continue
        ls = local_shape(e.shape, e.mesh_spec, sizes)
        unit = unit_of(e.fqn)
        units[unit] += math.prod(ls)
        own = max(own, dtype_bytes(e.dtype))
    pb = dtype_bytes(prec.compute) if prec else own
    gb = dtype_bytes(prec.reduce) if prec else own
    # the units kept gathered from forward to backward (every one at stage 2, those past
    # ``reshard`` at stage 3), and of those freed after the forward the two largest
    freed = t.resharded(plan.model.blocks)
    held = [n for u, n in units.items() if u not in freed] + \
        sorted((n for u, n in units.items() if u in freed), reverse=True)[:2]
    # FSDP2 gathers into buffers of its own, beside the shards (at any world size).
    rows = [ActRow(module="(gathered parameters)", op="all_gather", dtype="",
                   shape=(sum(held),), bytes=sum(held) * pb)]
    rows.append(ActRow(module="(unit gradient)", op="reduce_scatter", dtype="",
                       shape=(max(units.values(), default=0),),
                       bytes=max(units.values(), default=0) * gb))
    return rows
