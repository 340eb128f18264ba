"""Ulysses sequence parallelism on unmodified Hugging Face models.

The blocks run on a slice of the sequence; attention goes through an implementation
registered in Hugging Face's ``AttentionInterface`` (the extension point transformers
offers for attention kernels), which trades the sequence for heads with an all-to-all,
runs causal SDPA over the whole sequence for its heads, and trades back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import _collectives as C
from ._errors import ConfigError, SpecError

NAME = "meshlab_ulysses"
_GROUPS: dict[int, object] = {}      # model id -> sequence group, read by the attention fn


def _a2a(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if x.shape[scatter] % n:
        raise SpecError(f"sequence(all_to_all): dim {scatter} of size {x.shape[scatter]} does "
                        f"not divide over {n} ranks (heads must divide over the axis)")
    inp = torch.stack(x.chunk(n, dim=scatter)).contiguous()     # (n, ...)
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(list(out.unbind(0)), dim=gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter, gather):
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _a2a(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group, ctx.gather, ctx.scatter), None, None, None


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """(B, H, S/n, D) per rank -> heads split, whole sequence -> causal SDPA -> back."""
    group = _GROUPS[getattr(module, "_meshlab_model_id")]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:                                   # GQA: one K/V per query head
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))  # (B, H/n, S, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0)
    out = _AllToAll.apply(out, group, 2, 1)          # (B, H, S/n, D)
    return out.transpose(1, 2).contiguous(), None


def install(model: nn.Module, blocks: tuple[str, ...], group) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    _GROUPS[id(model)] = group
    cfg = model.config
    cfg._attn_implementation = NAME
    for sub in model.modules():
        if hasattr(sub, "config") and sub is not model:
            try:
                sub.config._attn_implementation = NAME
            except AttributeError:
                pass
    mods = dict(model.named_modules())
    for b in blocks:
        for m in mods[b].modules():
            m._meshlab_model_id = id(model)

    def split(_m, args, kwargs):
        n = dist.get_world_size(group)
        h = args[0] if args else kwargs["hidden_states"]
        if h.shape[1] % n:
            raise SpecError(f"sequence(all_to_all): sequence length {h.shape[1]} does not divide "
                            f"over {n} ranks; pad the batch to a multiple of {n}")
        h = C.split_seq(h, group, 1)
        kwargs = dict(kwargs)
        pe = kwargs.get("position_embeddings")
        if pe is not None:     # rotary cos/sin were computed for the whole sequence
            kwargs["position_embeddings"] = tuple(C.split_seq(t, group, 1) for t in pe)
        if args:
            return (h,) + tuple(args[1:]), kwargs
        kwargs["hidden_states"] = h
        return args, kwargs

    def split_every(_m, args, kwargs):
        return split(_m, args, kwargs)

    # The first block receives the whole sequence; later blocks receive it already
    # split, but still get whole-sequence rotary tables, so those are split for each.
    def split_pe_only(_m, args, kwargs):
        pe = kwargs.get("position_embeddings")
        if pe is None:
            return None
        kwargs = dict(kwargs)
        kwargs["position_embeddings"] = tuple(C.split_seq(t, group, 1) for t in pe)
        return args, kwargs

    mods[blocks[0]].register_forward_pre_hook(split_every, with_kwargs=True)
    for b in blocks[1:]:
        mods[b].register_forward_pre_hook(split_pe_only, with_kwargs=True)

    def gather(_m, _args, out):
        if isinstance(out, torch.Tensor):
            return C.gather_seq_replicated(out, group, 1)
        return (C.gather_seq_replicated(out[0], group, 1),) + tuple(out[1:])

    mods[blocks[-1]].register_forward_hook(gather)


def check(model: nn.Module, n: int) -> None:
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if heads is None:
        raise ConfigError("sequence(all_to_all) needs a Hugging Face model (config with "
                          "num_attention_heads)")
    if heads % n:
        raise ConfigError(f"sequence(all_to_all): {heads} attention heads do not divide over "
                          f"{n} ranks; use a sequence axis size that divides {heads}")
