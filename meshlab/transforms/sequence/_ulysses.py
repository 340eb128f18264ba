"""Ulysses sequence parallelism on unmodified Hugging Face models.

The blocks run on a slice of the sequence; attention goes through an implementation
registered in Hugging Face's ``AttentionInterface`` (the extension point transformers
offers for attention kernels), which trades the sequence for heads with an all-to-all,
runs causal SDPA over the whole sequence for its heads, and trades back. Padded and packed
batches: the name is registered with transformers' SDPA mask function too, so the model
builds its 4-D mask of the whole sequence (the padding, and packed samples from their
position ids) before the blocks split it, and each rank, which holds the whole sequence
for its heads after the exchange, hands that mask to SDPA as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...core import collectives as C
from ...core.errors import SpecError
from .._seqsplit import install_split

NAME = "meshlab_ulysses"
FUSED = "meshlab_ulysses_fused"      # the same, each rank's heads on meshlab::attention


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


def sp_group(module: nn.Module):
    """The sequence-parallel group an attention module of a routed block runs over
    (``_route_attention`` gave it)."""
    return module._meshlab_sp_group


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """(B, H, S/n, D) per rank -> heads split, whole sequence -> causal SDPA (with the
    model's whole-sequence mask where it builds one: padded or packed rows) -> back."""
    from ...ops._attention_hf import refuse_unread

    refuse_unread(module, kwargs, "sequence(all_to_all)'s attention (SDPA)",
                  "split the sequence with tensor parallelism's Megatron SP instead")
    group = sp_group(module)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:                                   # GQA: one K/V per query head
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))  # (B, H/n, S, D)
    if attention_mask is not None:
        attention_mask = _whole_mask(attention_mask, q.shape[2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                         is_causal=attention_mask is None, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0)
    out = _AllToAll.apply(out, group, 2, 1)          # (B, H, S/n, D)
    return out.transpose(1, 2).contiguous(), None


def fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    """:func:`attention` with each rank's heads over the whole sequence on
    ``meshlab::attention`` (``fuse('attention')`` beside Ulysses): the K/V heads travel as
    they are where they divide over the axis (grouped-query attention kept, n times fewer
    bytes than expanded), else expanded to the query heads as :func:`attention` sends
    them; the whole-sequence mask is read as the fused op reads any (causal within
    segments, or refused by name)."""
    from ...ops._attention_hf import hf_attention

    group = sp_group(module)
    n = dist.get_world_size(group)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and key.shape[1] % n:              # K/V heads do not divide: one per q head
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))  # (B, H/n, S, D)
    if attention_mask is not None:
        attention_mask = _whole_mask(attention_mask, q.shape[2])
    out, _ = hf_attention(module, q, k, v, attention_mask, scaling=scaling, dropout=dropout,
                          **kwargs)                  # (B, S, H/n, D)
    out = _AllToAll.apply(out.transpose(1, 2), group, 2, 1)      # (B, H, S/n, D)
    return out.transpose(1, 2).contiguous(), None


def _whole_mask(mask, s: int):
    """The model's 4-D mask of the whole sequence (B, 1 or H, S, S), as SDPA takes it."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or \
            tuple(mask.shape[-2:]) != (s, s) or mask.shape[1] != 1:
        from ...core.errors import ConfigError

        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ConfigError(f"sequence(all_to_all): the model handed its attention a {got} "
                          f"mask; Ulysses attention takes the 4-D mask (B, 1, S, S) of the "
                          f"whole sequence ({s} tokens) that transformers' SDPA mask function "
                          f"builds")
    return mask


def register_mask(name: str) -> None:
    """transformers builds its SDPA mask for attention named ``name`` (None for a batch
    without padding or packing, else the 4-D mask of the whole sequence)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register(name, sdpa_mask)


PROFILE_NAME = "meshlab_ulysses_profile"


def profile_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """What :func:`attention` keeps, on one process and at the whole sequence, for the
    activation profile (``Sequence.profile``; the room divides it by the axis): SDPA
    saves q and the K/V expanded to every query head (a rank's are the all-to-all's
    outputs, H/n heads of the whole sequence, as many bytes as S/n of every head), its
    output and log-sum-exps; the output's all-to-all back makes a new (B, H, S/n, D)
    tensor, and its transpose is copied for o_proj, which keeps the copy. The
    all-to-alls' send and receive buffers live only while they run."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         dropout_p=dropout if module.training else 0.0)
    out = out.clone(memory_format=torch.contiguous_format)   # the all-to-all's output
    return out.transpose(1, 2).contiguous(), None


def install(model: nn.Module, blocks: tuple[str, ...], group, held: frozenset,
            fused: bool = False) -> None:
    """Attention over ``group`` in the ``held`` blocks (this rank's, of the model's
    ``blocks``), the sequence split before the model's first block and joined after its
    last (``install_split``); ``fused``: each rank's heads on ``meshlab::attention``
    (:func:`fused_attention`) instead of SDPA."""
    from transformers import AttentionInterface

    name = FUSED if fused else NAME
    AttentionInterface.register(name, fused_attention if fused else attention)
    register_mask(name)
    _route_attention(model, tuple(b for b in blocks if b in held), group, name)
    n = dist.get_world_size(group)

    def split(h):
        if h.shape[1] % n:
            raise SpecError(f"sequence(all_to_all): sequence length {h.shape[1]} does not divide "
                            f"over {n} ranks; pad the batch to a multiple of {n}")
        return C.split_seq(h, group, 1)

    install_split(model, blocks, split, lambda h: C.gather_seq_replicated(h, group, 1), held)


def set_attention(model: nn.Module, name: str) -> None:
    """Every config of the model names ``name`` as its attention."""
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None:
            try:
                cfg._attn_implementation = name
            except AttributeError:
                pass


def _route_attention(model: nn.Module, blocks: tuple[str, ...], group, name: str) -> None:
    """Every config of the model names ``name`` as its attention; the blocks' modules
    carry the sequence group the attention function reads."""
    set_attention(model, name)
    mods = dict(model.named_modules())
    for b in blocks:
        for m in mods[b].modules():
            m._meshlab_sp_group = group
