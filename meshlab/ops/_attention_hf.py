"""``meshlab::attention`` behind transformers' ``AttentionInterface``: :func:`hf_attention`
takes the arguments transformers hands an attention implementation, reads the segments of
a padded or packed batch from its 4-D mask (:func:`causal_segments`; any other mask is
refused by name) and runs :func:`meshlab.ops.attention.attention`; :func:`register_hf`
registers it as ``attn_implementation="meshlab"``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.errors import ConfigError
from .attention import HF_NAME, attention

# Keyword arguments of transformers' attention interface that ask for math this op lacks:
# soft-capping, attention sinks, a relative position bias, a sparse attention's chosen keys
# (DeepSeek-V3.2's indexer, MiniMax-M3's blocks).
_HF_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias", "indices", "block_indices")
# Those that ask for none (the packed batch's positions and lengths, which the mask also
# gives; the cache's position; flags). Any other tensor or float is refused by name: an
# argument this op does not read would otherwise be ignored without an error.
_HF_READ_ELSEWHERE = frozenset((
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "cache_position", "sliding_window",
    "max_length_q", "max_length_k", "is_causal", "output_attentions", "use_cache",
    "deterministic", "layer_idx"))


def refuse_unread(module, kwargs: dict, what: str = "meshlab attention",
                  fix: str = "use attn_implementation='sdpa' or 'eager' for this model") -> None:
    """Raise ``ConfigError`` naming the first keyword argument of transformers' attention
    call that asks for math ``what`` lacks."""
    for name, value in kwargs.items():
        if value is None or value is False:
            continue
        if name in _HF_UNSUPPORTED or (name not in _HF_READ_ELSEWHERE
                                       and isinstance(value, (Tensor, float))):
            raise ConfigError(f"{what} does not support {name!r} (asked by "
                              f"{type(module).__name__}); {fix}")


def _attended(mask: Tensor):
    """``(ok, seen)`` of a materialized mask: ``seen`` True where a query attends to a key
    (bool: True; float: 0), ``ok`` a tensor that holds where a float mask is only 0 or
    very negative (None for bool); None for a mask of another dtype."""
    if mask.dtype == torch.bool:
        return None, mask
    if mask.is_floating_point():
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        return ((mask == 0) | blocked).all(), mask == 0
    return None


def _is_plain_causal(mask: Tensor, s: int, skv: int) -> bool:
    """Whether a materialized 4-D mask (bool: True = attend; float: 0 = attend, very negative
    = masked) is exactly the top-left causal mask for every batch row and head.

    Under ``torch.compile`` the values cannot be read without breaking the graph: the check
    becomes a device-side assertion (``torch._assert_async``) that fails the step when the
    mask is not causal, and the shapes and dtype are still checked here."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (s, skv) or s != skv:
        return False
    read = _attended(mask)
    if read is None:
        return False
    ok, seen = read
    # (arange, not tril: inductor of torch 2.11 fails to lower tril over symbolic sizes)
    rows = torch.arange(s, device=mask.device).unsqueeze(1)
    same = (seen == (torch.arange(skv, device=mask.device) <= rows)).all()
    ok = same if ok is None else ok & same
    if torch.compiler.is_compiling():
        torch._assert_async(ok, "meshlab attention: the attention mask is not the plain "
                                "causal one; use attn_implementation='sdpa'")
        return True
    return bool(ok)


def causal_segments(mask: Tensor) -> Tensor | None:
    """Segment ids (B, S) int64 under which the materialized 4-D ``mask`` (bool: True =
    attend; float: 0 = attend, very negative = masked; heads broadcast or all equal) is
    causal attention within segments, for every query a key attends to: the mask
    transformers builds for padded rows (``attention_mask``) and for packed samples
    (``position_ids`` that start again). None where it is not that (a sliding window, a
    bidirectional or custom mask, or dtypes and shapes that cannot be one).

    A token no query attends to (padding) becomes a segment of its own, which sees itself
    alone: its output is 0 or the mean of the row's keys under transformers' mask and
    never reaches another token; only a loss that reads it could tell (``fuse``'s
    ``check_batch`` refuses labels that would). Every other token's segment is the first
    key its row attends to, and the mask must be exactly causal within those segments.

    Under ``torch.compile`` the check is a device-side assertion, as in
    :func:`_is_plain_causal`, and the ids are returned."""
    if mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return None
    read = _attended(mask)
    if read is None:
        return None
    ok, seen = read
    heads = seen[:, :1]
    ok = (seen == heads).all() if ok is None else ok & (seen == heads).all()
    seen = heads[:, 0]                                                    # (B, S, S)
    s = seen.shape[-1]
    idx = torch.arange(s, device=seen.device)
    pad = ~seen.any(dim=-2)                                  # no query attends to it
    first = torch.where(seen.any(-1), seen.to(torch.int8).argmax(-1), idx)  # first key seen
    seg = torch.where(pad, idx, first)                      # (B, S)
    want = (seg[:, :, None] == seg[:, None, :]) & (idx[None, :] <= idx[:, None])
    same = ((want == seen) | pad[:, :, None]).all()        # padding rows: anything
    ok = same if ok is None else ok & same
    if torch.compiler.is_compiling():
        torch._assert_async(ok, "meshlab attention: the attention mask is not causal "
                                "within segments; use attn_implementation='sdpa'")
        return seg
    return seg if bool(ok) else None


_LAST_SEGMENTS: list = []        # [(mask, its segments)]: the layers of one forward share it


def _segments_of(mask: Tensor) -> Tensor | None:
    """:func:`causal_segments` of ``mask``, read once per mask (every layer of a forward
    gets the same one)."""
    if not torch.compiler.is_compiling() and _LAST_SEGMENTS and _LAST_SEGMENTS[0][0] is mask:
        return _LAST_SEGMENTS[0][1]
    seg = causal_segments(mask)
    if not torch.compiler.is_compiling():
        _LAST_SEGMENTS[:] = [(mask, seg)]
    return seg


def _describe(mask) -> str:
    if isinstance(mask, Tensor):
        return f"{str(mask.dtype).removeprefix('torch.')} {tuple(mask.shape)}"
    return type(mask).__name__


def as_autocast(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What autocast does to SDPA's inputs, for attention that autocast does not see (a
    custom op, an autograd Function): under autocast q, k and v in its dtype (q and k
    leave a float32 rotary table in float32 while v leaves its projection in bf16);
    outside it, as they are."""
    dev = q.device.type
    if not torch.is_autocast_enabled(dev):
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return q.to(dt), k.to(dt), v.to(dt)


def hf_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Tensor | None, scaling: float | None = None,
                 dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers ``AttentionInterface`` entry: query (B, Hq, S, D), key, value
    (B, Hkv, Skv, D) -> (attn_output (B, S, Hq, D) contiguous, None).

    Causal when the module is (``module.is_causal``, or an ``is_causal`` keyword) and more
    than one query is given, as the SDPA integration decides. ``attention_mask`` must be
    ``None`` (what transformers' SDPA mask function gives for an unpadded batch, see
    :func:`register_hf`), exactly the causal mask, or causal within segments (padded rows,
    packed samples: :func:`causal_segments`, run with ``segments``); sliding-window,
    bidirectional or custom masks, dropout, soft-capping and sinks raise
    :class:`~meshlab.ConfigError`.
    """
    if dropout:
        raise ConfigError(f"meshlab attention has no dropout, got dropout={dropout} from "
                          f"{type(module).__name__}; set the config's attention_dropout to 0, "
                          f"or use attn_implementation='sdpa'")
    refuse_unread(module, kwargs)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    s, skv = query.shape[2], key.shape[2]
    segments = None
    if attention_mask is not None:
        plain = is_causal and isinstance(attention_mask, Tensor) and \
            _is_plain_causal(attention_mask, s, skv)
        if not plain:
            if is_causal and isinstance(attention_mask, Tensor) and s == skv > 1 and \
                    tuple(attention_mask.shape[-2:]) == (s, skv):
                segments = _segments_of(attention_mask)
            if segments is None:
                raise ConfigError(
                    f"meshlab attention supports causal masks, and causal masks within "
                    f"segments (padded rows, packed samples); got a "
                    f"{_describe(attention_mask)} mask that is neither (a sliding window, a "
                    f"bidirectional or custom mask). Use attn_implementation='sdpa'")
    causal = bool(is_causal and s > 1)        # a SymBool under dynamic shapes -> bool
    if causal and skv > s:
        # Prefill into an empty static cache: the slots past S are empty (the mask function
        # returned None only because of that), so drop them, as the SDPA integration does.
        key, value = key[:, :, :s], value[:, :, :s]
    query, key, value = as_autocast(query, key, value)
    out = attention(query, key, value, causal=causal, scale=scaling, segments=segments)
    return out.transpose(1, 2).contiguous(), None


def register_hf() -> str:
    """Register :func:`hf_attention` with transformers as ``attn_implementation="meshlab"``.

    Also registers transformers' SDPA mask function under the same name, so a batch
    without padding reaches :func:`hf_attention` with ``attention_mask=None`` and a padded
    or packed one with an explicit mask, which it reads as segments (a name without a mask
    function would get ``None`` in both cases and silently attend to padding). Idempotent;
    returns the name.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HF_NAME, hf_attention)
    AttentionMaskInterface.register(HF_NAME, sdpa_mask)
    return HF_NAME
