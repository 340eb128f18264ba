"""Differentiable collectives for tensor and sequence parallelism (Megatron's f and g).

Each is an autograd function over one process group whose backward is the adjoint
collective: an identity forward pairs with an all-reduce backward, an all-gather with a
reduce-scatter, and so on. Inputs and outputs are plain (local) tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import SpecError

# Custom ops that communicate inside their implementation (``meshlab_comm::``: ring
# attention's point-to-point shifts): the op's qualified name -> its implementation, which
# a counter of collectives runs under its own dispatch mode to see those exchanges
# (``meshlab.estimate.comm.CommCounter``; a dispatch mode sees a custom op as one call).
COMMUNICATING_OPS: dict = {}


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """``out`` (n * len, ...) <- every rank's ``inp``, concatenated on dim 0."""
    fn = getattr(dist, "all_gather_single", None)        # torch >= 2.13
    (fn or dist.all_gather_into_tensor)(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """``out`` <- this rank's dim-0 slice of the sum of every rank's ``inp``."""
    fn = getattr(dist, "reduce_scatter_single", None)    # torch >= 2.13
    (fn or dist.reduce_scatter_tensor)(out, inp, group=group)


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0],) + tuple(front.shape[1:]))
    all_gather_into(out, front, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise SpecError(f"sequence parallel: dim {dim} of size {x.shape[dim]} does not divide "
                        f"over {n} ranks; pad the sequence to a multiple of {n}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n,) + tuple(front.shape[1:]))
    reduce_scatter_into(out, front, group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise SpecError(f"sequence parallel: sequence length {x.shape[dim]} (dim {dim}) does not "
                        f"divide over {n} ranks; pad the batch to a multiple of {n}")
    r = dist.get_rank(group)
    return x.chunk(n, dim=dim)[r].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (input of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (output of a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter backward (enter an SP region)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, ctx.dim), None, None


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather backward (leave an SP region)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, ctx.dim), None, None


class _SplitSeq(torch.autograd.Function):
    """Keep this rank's chunk along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, ctx.dim), None, None


class _GatherReplicated(torch.autograd.Function):
    """All-gather along ``dim`` forward, keep the local chunk backward: for a gathered
    value whose consumers run replicated (their gradient is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, ctx.dim), None, None


def copy_to_region(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    return _ReduceFromRegion.apply(x, group)


def gather_seq(x, group, dim: int = 1):
    return _GatherSeq.apply(x, group, dim)


def scatter_seq(x, group, dim: int = 1):
    return _ScatterSeq.apply(x, group, dim)


def split_seq(x, group, dim: int = 1):
    return _SplitSeq.apply(x, group, dim)


def gather_last(x, group):
    return _GatherReplicated.apply(x, group, x.dim() - 1)


def gather_seq_replicated(x, group, dim: int = 1):
    return _GatherReplicated.apply(x, group, dim)
