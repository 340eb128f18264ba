"""Small tensor helpers shared by the runtime, checkpoints and ops (no plan, no mesh)."""

from __future__ import annotations

import torch


def local(t):
    """The local shard of a DTensor; any other tensor as it is. Decided by type, not by
    ``getattr(t, "to_local", None)``: dynamo reads that as None for a DTensor parameter,
    which would hand a compiled block the DTensor where its local shard belongs."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def shard_groups(t) -> tuple:
    """The process groups over which ``t``'s local data is a disjoint piece (the mesh
    dimensions a DTensor is sharded over, of size > 1); none for any other tensor."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(t.placements)
                 if isinstance(pl, (Shard, _StridedShard)) and mesh.size(i) > 1)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def scale_grad(x, factor: float):
    """``x`` as it is, its gradient multiplied by ``factor``."""
    return _ScaleGrad.apply(x, factor)
