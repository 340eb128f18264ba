"""Tensor and sequence parallelism on unmodified modules.

Each tensor-parallel module keeps its parameters as DTensors (the optimizer, gradient
clipping and checkpoints see global tensors) but runs its own ``forward`` on the local
shards: its style's pre-forward hook puts the local views where the forward looks for
``self.weight`` / ``self.bias``, and the differentiable collectives of ``_collectives``
join the regions (Megatron's f and g; all-gather / reduce-scatter under sequence
parallelism). No Hugging Face ``forward`` is copied or replaced. The styles are in
``_styles``. This is the path for plans whose policy marks tensor-parallel regions;
without regions the model runs on DTensors instead (``_dtensor``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ...core import collectives as C
from ...core.errors import ConfigError
from ...core.placement import dim_block
from .._seqsplit import gather_after, hidden_arg, split_before, with_hidden
from . import _rng
from ._styles import TPGroup


@dataclasses.dataclass(frozen=True)
class TPModule:
    fqn: str
    style: Any                           # a style of ``_styles``


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """Everything the TP materializer needs, computed from a bound plan (pure)."""

    axis: str
    modules: tuple[TPModule, ...]
    regions: tuple[str, ...] = ()        # modules whose input enters a TP region
    sequence_parallel: bool = False
    first_block: str | None = None       # SP: where the sequence is split
    last_block: str | None = None        # SP: where it is gathered again
    attrs: tuple[tuple[str, str, Any], ...] = ()   # (module, attribute, local value)
    dtensor: bool = False                # DTensor mode (``_dtensor``): no regions, no hooks
    all_inputs: tuple[str, ...] = ()     # regions whose every tensor input enters (q=, k=, v=)
    # (module, keyword, dim, heads, first, count): an argument over every head, cut to
    # this rank's heads [first, first + count) before the module runs
    head_args: tuple[tuple[str, str, int, int, int, int], ...] = ()


def _local_slice(t: torch.Tensor, placement, rank: int, n: int) -> torch.Tensor:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        parts = t.chunk(placement.split_factor, dim=placement.dim)
        return torch.cat([p.chunk(n, dim=placement.dim)[rank] for p in parts],
                         dim=placement.dim).contiguous()
    if isinstance(placement, Shard):
        o, ln = dim_block(t.shape[placement.dim], [n], [rank])
        # clone: a view would keep the whole tensor's storage alive
        return t.narrow(placement.dim, o, ln).clone(memory_format=torch.contiguous_format)
    return t


def shard_param(p: torch.Tensor, placements, mesh, rank: int, n: int, requires_grad: bool):
    """A full (identical on every tp rank) tensor -> a DTensor parameter holding this
    rank's shard. No communication: every rank already has the full value."""
    from torch.distributed.tensor import DTensor

    local = _local_slice(p.detach(), placements[0], rank, n)
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape,
                            stride=p.stride())
    return nn.Parameter(dt, requires_grad=requires_grad)


def shard_module(m: nn.Module, spec: TPModule, tp: TPGroup, swapped: dict) -> None:
    """Replace ``m``'s parameters by DTensors holding this rank's shard (no communication:
    every rank holds the same full values). ``swapped`` maps already-replaced tensors so
    tied parameters stay one object."""
    for name, p in list(m._parameters.items()):
        if p is None:
            continue
        if id(p) in swapped:
            m._parameters[name] = swapped[id(p)][1]
            continue
        pl = spec.style.placements(name, p.dim())
        if pl is None:
            continue  # stays a plain replicated parameter; its gradient is tp-reduced
        newp = shard_param(p, pl, tp.mesh, tp.rank, tp.size, p.requires_grad)
        swapped[id(p)] = (p, newp)  # holding p keeps its id from being reused
        m._parameters[name] = newp


def install_hooks(model: nn.Module, layout: TPLayout, tp: TPGroup) -> None:
    """Install the forward hooks of every TP module, region entry and SP split, and the
    switches between the shared and this rank's random streams (``_rng``)."""
    mods = dict(model.named_modules())
    for spec in layout.modules:
        pre, post = spec.style.hooks(mods[spec.fqn], tp)
        mods[spec.fqn].register_forward_pre_hook(pre)
        mods[spec.fqn].register_forward_hook(post)

    for fqn in layout.regions:
        def region_entry(_m, args, kwargs):
            where, x = hidden_arg(args, kwargs)
            x = C.gather_seq(x, tp.group, 1) if tp.sp else C.copy_to_region(x, tp.group)
            return with_hidden(args, kwargs, where, x)

        entry = _all_inputs_entry(tp) if fqn in layout.all_inputs else region_entry
        mods[fqn].register_forward_pre_hook(entry, with_kwargs=True)

    if tp.sp and layout.first_block is not None:
        # Everything after the blocks (final norm, head, model-specific reshapes) runs on
        # the whole sequence, replicated over tp.
        split = lambda x: C.split_seq(x, tp.group, 1)
        gather = lambda x: C.gather_seq_replicated(x, tp.group, 1)
        mods[layout.first_block].register_forward_pre_hook(split_before(split), with_kwargs=True)
        mods[layout.last_block].register_forward_hook(gather_after(gather, layout.last_block))

    for fqn, kw, dim, heads, first, count in layout.head_args:
        mods[fqn].register_forward_pre_hook(_head_slicer(kw, dim, heads, first, count),
                                            with_kwargs=True)

    for fqn, attr, value in layout.attrs:
        setattr(mods[fqn], attr, value)

    # dropout in a sharded region draws from this rank's own stream (``_rng``)
    _rng.install(model, layout, tp)


def _all_inputs_entry(tp: TPGroup):
    """A region entry for a module with several inputs (SAM's attention takes query, key
    and value by keyword): each floating-point tensor argument enters the region (f), so
    the gradient reaching each input is summed over tp. The layout refuses these regions
    under sequence parallelism."""
    enter = lambda x: C.copy_to_region(x, tp.group) if isinstance(x, torch.Tensor) and \
        x.is_floating_point() else x

    def hook(_m, args, kwargs):
        return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}

    return hook


def own_heads(x: torch.Tensor, dim: int, heads: int, first: int, count: int) -> torch.Tensor:
    """This rank's heads of ``x``, whose ``dim`` (from the end when negative) holds every
    head; as the first dim it is batch x heads, heads inner. A dim of size 1 broadcasts
    over the heads and is kept whole."""
    dim %= x.dim()
    size = x.shape[dim]
    if size == 1:
        return x
    if size % heads if dim == 0 else size != heads:
        raise ConfigError(f"a tensor of shape {tuple(x.shape)} does not carry {heads} heads "
                          f"on dim {dim}, where the policy's head_args say it does")
    lead, tail = x.shape[:dim], x.shape[dim + 1:]
    y = x.reshape(-1, heads, *tail)[:, first:first + count]
    return y.reshape(*lead, size // heads * count, *tail)


def _head_slicer(kw: str, dim: int, heads: int, first: int, count: int):
    def hook(_m, args, kwargs):
        if kw not in kwargs:
            raise ConfigError(f"{type(_m).__name__} was called without the keyword {kw!r}, "
                              f"which the policy cuts to this rank's heads (head_args); "
                              f"passed by position it would reach the module whole")
        x = kwargs[kw]
        if not isinstance(x, torch.Tensor):
            return None
        return args, {**kwargs, kw: own_heads(x, dim, heads, first, count)}

    return hook
