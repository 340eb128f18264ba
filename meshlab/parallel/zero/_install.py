"""What ``zero_shard`` installs and the parts that synchronize gradients at run time."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from ..._collectives import flat_all_reduce
from ..._tensors import local as _local
from .._protocol import Part
from ..precision import Precision
from ._zero1 import Zero1Buffers


@dataclasses.dataclass
class AllReducePart(Part):
    """Stage 0: every gradient averaged over the data-parallel group (one flat all-reduce
    per dtype)."""

    order: ClassVar[int] = 10     # after the tensor/sequence-parallel sums
    group: Any
    size: int
    names: frozenset | None = None   # only these parameters (None: all)

    def sync_grads(self, params: list) -> None:
        if self.size == 1:
            return
        grads = [_local(p.grad) for n, p in params if p.grad is not None
                 and (self.names is None or n in self.names)]
        if grads:
            flat_all_reduce(grads, self.group, self.size)


@dataclasses.dataclass
class FSDPPart(AllReducePart):
    """Stages 2/3: FSDP2 reduce-scattered (and averaged) the gradients in backward;
    parameters it ignored are all-reduced here."""

    casts_params: ClassVar[bool] = True

    def set_gradient_sync(self, model, enabled: bool) -> None:
        model.set_requires_gradient_sync(enabled)


@dataclasses.dataclass
class Zero1Part(Part):
    """Stage 1: the inner optimizer updates fp32 slices (``Zero1Buffers``); gradients are
    reduce-scattered into them and the updated slices all-gathered back."""

    order: ClassVar[int] = 10
    group: Any
    size: int
    buffers: Zero1Buffers | None = None

    def optimizer_params(self, params: list) -> list | None:
        if self.size == 1:
            return None
        self.buffers = Zero1Buffers([p for _, p in params], self.group, self.size)
        return self.buffers.shards

    def sync_grads(self, params: list) -> None:
        if self.buffers is not None:
            self.buffers.sync()

    def grad_items(self, items: list) -> list:
        if self.buffers is None:
            return items
        return [(s.grad, b.groups + (self.group,)) for s, b in
                zip(self.buffers.shards, self.buffers.buckets) if s.grad is not None]

    def after_step(self) -> None:
        if self.buffers is not None:
            self.buffers.gather()


def install_zero(t, ctx) -> Part:
    group, size = ctx.group(*t.axis), ctx.size(*t.axis)
    if t.stage == 1:
        return Zero1Part(group, size)
    if t.stage == 0:
        return AllReducePart(group, size)
    ignored = _fully_shard(t, ctx)
    names = frozenset(n for n, p in ctx.model.named_parameters() if p in ignored)
    return FSDPPart(group, size, names)


def _fully_shard(t, ctx) -> set:
    """FSDP2 over the blocks, then the root. Returns the parameters it leaves replicated."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    prec = ctx.plan.get(Precision)
    # FSDP2 reads reduce_dtype=None as "the compute dtype": name fp32 explicitly.
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, prec.compute) if prec and prec.compute != "float32" else None,
        reduce_dtype=getattr(torch, prec.reduce) if prec else None)
    model, mods = ctx.model, dict(ctx.model.named_modules())
    if ctx.roles.fsdp:
        ignored, placement = _by_spec(ctx)
    else:
        ignored, placement = _strided_on_dim0(model), None
    kw = dict(mesh=ctx.device_mesh(*t.axis), reshard_after_forward=t.stage == 3,
              mp_policy=mp, ignored_params=ignored or None)
    if placement is not None:
        kw["shard_placement_fn"] = placement
    for b in (b for b in ctx.plan.model.blocks if b in mods and b not in ctx.dropped):
        fully_shard(mods[b], **kw)
    fully_shard(model, **kw)
    return ignored


def _strided_on_dim0(model) -> set:
    """FSDP2 shards dim 0; a parameter already strided on dim 0 by TP (a packed q|k|v
    bias) stays replicated over dp and its gradient is all-reduced instead."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return {p for p in model.parameters() if isinstance(p, DTensor) and any(
        isinstance(pl, _StridedShard) and pl.dim == 0 for pl in p.placements)}


def _by_spec(ctx):
    """2-D layouts (``P('fsdp', 'tp')``): each parameter is sharded on the dimension its
    spec gives the data axis; one its spec keeps whole there stays replicated."""
    from torch.distributed.tensor import Shard

    fsdp = set(ctx.roles.fsdp)
    dim_of = {}
    for e in ctx.plan.params:
        dims = [d for d in range(len(e.mesh_spec)) if set(e.mesh_spec.dim_axes(d)) & fsdp]
        if dims:
            dim_of[e.fqn] = dims[0]
    by_id = {}
    ignored = set()
    for n, p in ctx.model.named_parameters():
        if n in dim_of:
            by_id[id(p)] = Shard(dim_of[n])
        else:
            ignored.add(p)
    return ignored, lambda p: by_id.get(id(p), Shard(0))
