"""Tensor and sequence parallelism on unmodified modules.

Each tensor-parallel module keeps its parameters as DTensors (the optimizer, gradient
clipping and checkpoints see global tensors) but runs its own ``forward`` on the local
shards: a pre-forward hook puts the local views where the forward looks for
``self.weight`` / ``self.bias``, and the differentiable collectives of ``_collectives``
join the regions (Megatron's f and g; all-gather / reduce-scatter under sequence
parallelism). No Hugging Face ``forward`` is copied or replaced.

Kinds of module (``TPModule.kind``):

=============  ===========================  ==============================================
kind           parameters (DTensor on tp)    forward
=============  ===========================  ==============================================
colwise        weight/bias split on out      local matmul; region entry does f / gather
rowwise        weight split on in; bias R    local matmul, then g / reduce-scatter, + bias
vocab_embed    weight split on vocab rows    ids outside the shard masked, then g
vocab_head     weight (and bias) on vocab    f / gather on input; logits stay vocab-sharded
kv_replicated  weight/bias replicated        local heads of a replicated K/V projection
=============  ===========================  ==============================================
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from . import _collectives as C
from ._placement import dim_block
from ._tensors import local as _local


@dataclasses.dataclass(frozen=True)
class TPModule:
    fqn: str
    kind: str
    conv1d: bool = False          # GPT-2 Conv1D: weight is (in, out)
    packed: int = 1               # fused projections (q|k|v): shard each part
    in_region: bool = False       # input already entered the TP region (no f here)
    gather_output: bool = False   # vocab_head: all-gather the logits instead of sharding
    kv_heads: tuple[int, int] = (0, 0)   # kv_replicated: (first head, count) kept locally
    head_dim: int = 0


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """Everything the TP materializer needs, computed from a bound plan (pure)."""

    axis: str
    modules: tuple[TPModule, ...]
    regions: tuple[str, ...] = ()        # modules whose input enters a TP region
    sequence_parallel: bool = False
    first_block: str | None = None       # SP: where the sequence is split
    last_block: str | None = None        # SP: where it is gathered again
    attn_groups: tuple[tuple[str, int], ...] = ()  # attention module -> local KV groups
    attrs: tuple[tuple[str, str, Any], ...] = ()   # (module, attribute, local value)


def _placements(kind: str, name: str, conv1d: bool, packed: int, ndim: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def shard(dim):
        return _StridedShard(dim, split_factor=packed) if packed > 1 else Shard(dim)

    if kind in ("colwise", "vocab_head"):
        if name == "bias" or ndim == 1:
            return (shard(0),)
        return (shard(1 if conv1d else 0),)
    if kind == "rowwise":
        if name == "bias" or ndim == 1:
            return (Replicate(),)
        return (Shard(0 if conv1d else 1),)
    if kind == "vocab_embed":
        return (Shard(0),)
    return (Replicate(),)


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


class _LocalParams:
    """Pre/post forward hooks that expose local shards as ``module.weight`` etc."""

    def __init__(self, names: tuple[str, ...], zero_bias: bool, conv1d: bool):
        self.names, self.zero_bias, self.conv1d = names, zero_bias, conv1d

    def enter(self, module: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        for n in self.names:
            p = module._parameters.get(n)
            if p is None:
                continue
            if n == "bias" and self.zero_bias:
                # Row-parallel: the bias is added once, after the reduction.
                module.__dict__[n] = torch.zeros_like(p.to_local() if isinstance(p, DTensor)
                                                      else p).detach() if self.conv1d else None
            else:
                module.__dict__[n] = p.to_local() if isinstance(p, DTensor) else p

    def exit(self, module: nn.Module) -> None:
        for n in self.names:
            module.__dict__.pop(n, None)


def _hidden_arg(args, kwargs):
    if args:
        return "args", args[0]
    if "hidden_states" in kwargs:
        return "kw", kwargs["hidden_states"]
    raise TypeError("tensor-parallel region entry: the module got no positional input and no "
                    "'hidden_states' keyword")


def _with_hidden(args, kwargs, where, new):
    if where == "args":
        return (new,) + tuple(args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = new
    return args, kwargs


def shard_module(m: nn.Module, spec: TPModule, tp_mesh, group, swapped: dict) -> None:
    """Replace ``m``'s parameters by DTensors holding this rank's shard (no communication:
    every rank holds the same full values). ``swapped`` maps already-replaced tensors so
    tied parameters stay one object."""
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for name, p in list(m._parameters.items()):
        if p is None:
            continue
        if id(p) in swapped:
            m._parameters[name] = swapped[id(p)][1]
            continue
        if spec.kind == "kv_replicated":
            continue  # stays a plain replicated parameter; its gradient is tp-reduced
        pl = _placements(spec.kind, name, spec.conv1d, spec.packed, p.dim())
        newp = shard_param(p, pl, tp_mesh, rank, n, p.requires_grad)
        swapped[id(p)] = (p, newp)  # holding p keeps its id from being reused
        m._parameters[name] = newp


def install_hooks(model: nn.Module, layout: TPLayout, tp_mesh, group) -> None:
    """Install the forward hooks of every TP module, region entry and SP split."""
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    mods = dict(model.named_modules())
    sp = layout.sequence_parallel
    for spec in layout.modules:
        _install(mods[spec.fqn], spec, group, tp_mesh, rank, n, sp)

    for fqn in layout.regions:
        def region_entry(_m, args, kwargs):
            where, x = _hidden_arg(args, kwargs)
            x = C.gather_seq(x, group, 1) if sp else C.copy_to_region(x, group)
            return _with_hidden(args, kwargs, where, x)

        mods[fqn].register_forward_pre_hook(region_entry, with_kwargs=True)

    if sp and layout.first_block is not None:
        def split_entry(_m, args, kwargs):
            where, x = _hidden_arg(args, kwargs)
            return _with_hidden(args, kwargs, where, C.split_seq(x, group, 1))

        mods[layout.first_block].register_forward_pre_hook(split_entry, with_kwargs=True)

        # Everything after the blocks (final norm, head, model-specific reshapes) runs on
        # the whole sequence, replicated over tp.
        def gather_exit(_m, _args, out):
            if isinstance(out, torch.Tensor):
                return C.gather_seq_replicated(out, group, 1)
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                return (C.gather_seq_replicated(out[0], group, 1),) + tuple(out[1:])
            raise TypeError(f"sequence parallel: {layout.last_block} returned "
                            f"{type(out).__name__}; expected a tensor or a tuple starting with one")

        mods[layout.last_block].register_forward_hook(gather_exit)

    for fqn, attr, value in layout.attrs:
        setattr(mods[fqn], attr, value)


def _install(m: nn.Module, spec: TPModule, group, tp_mesh, rank: int, n: int, sp: bool) -> None:
    kind = spec.kind
    names = tuple(k for k, v in m._parameters.items() if v is not None)
    local = _LocalParams(names, zero_bias=kind == "rowwise", conv1d=spec.conv1d)

    if kind == "colwise":
        def pre(mod, args):
            local.enter(mod)
            if not spec.in_region:
                return (C.copy_to_region(args[0], group),) + tuple(args[1:])

        def post(mod, args, out):
            local.exit(mod)
            return out

    elif kind == "rowwise":
        def pre(mod, args):
            local.enter(mod)

        def post(mod, args, out):
            local.exit(mod)
            out = C.scatter_seq(out, group, 1) if sp else C.reduce_from_region(out, group)
            b = mod._parameters.get("bias")
            return out if b is None else out + _local(b)

    elif kind == "vocab_embed":
        w = m._parameters["weight"]
        lo, cnt = dim_block(w.shape[0], [n], [rank])
        state: dict = {}

        def pre(mod, args):
            ids = args[0]
            state["mask"] = (ids < lo) | (ids >= lo + cnt)
            state["pad"] = pad = mod.padding_idx
            # F.embedding only uses padding_idx to zero that row's gradient.
            mod.padding_idx = pad - lo if pad is not None and lo <= pad < lo + cnt else None
            local.enter(mod)
            return ((ids - lo).clamp(0, max(cnt - 1, 0)),) + tuple(args[1:])

        def post(mod, args, out):
            local.exit(mod)
            mod.padding_idx = state.pop("pad")
            out = out.masked_fill(state.pop("mask").unsqueeze(-1), 0.0)
            return C.reduce_from_region(out, group)

    elif kind == "vocab_head":
        w = m._parameters["weight"]
        vocab = w.shape[1] if spec.conv1d else w.shape[0]

        def pre(mod, args):
            local.enter(mod)
            return (C.copy_to_region(args[0], group),) + tuple(args[1:])

        def post(mod, args, out):
            from torch.distributed.tensor import DTensor, Shard

            local.exit(mod)
            if spec.gather_output:
                return C.gather_last(out, group)
            shape = tuple(out.shape[:-1]) + (vocab,)
            return DTensor.from_local(out, tp_mesh, (Shard(out.dim() - 1),), run_check=False,
                                      shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())

    elif kind == "kv_replicated":
        first, count = spec.kv_heads
        lo_c, hi_c = first * spec.head_dim, (first + count) * spec.head_dim

        def pre(mod, args):
            local.enter(mod)

        def post(mod, args, out):
            local.exit(mod)
            return out[..., lo_c:hi_c]

    else:  # pragma: no cover - layouts are built by tp_layout only
        raise ValueError(kind)

    m.register_forward_pre_hook(pre)
    m.register_forward_hook(post)
