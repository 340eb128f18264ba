"""Fuse's ``rotary`` routing: a Hugging Face modeling file's ``apply_rotary_pos_emb`` on
``meshlab::rotary``.

The modeling file's function is wrapped once by a dispatcher that calls
``meshlab::rotary`` while a routed model's attention module is running (a forward
pre-hook and hook count them) and the original function otherwise, so other models in
the process are untouched. Each function is probed against the original before it is
wrapped. Queries and keys that are adjacent parts of one tensor (a merged query/key/value
product's row, outside autograd) are rotated in one launch.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types

import torch
from einops import rearrange
from torch import Tensor, nn

from ...core.errors import ConfigError
from ._residual import probe_close

_ROUTED = threading.local()         # depth of routed attention modules now running


def _active() -> bool:
    return getattr(_ROUTED, "depth", 0) > 0


def _adjacent(q: Tensor, k: Tensor) -> Tensor | None:
    """q (B, H, S, D) and k (B, Hkv, S, D) as one (B, S, H + Hkv, D) view where k's heads
    follow q's in memory at the same token strides (the parts of a merged query/key/value
    product), outside autograd and tracing; else None."""
    if type(q) is not Tensor or type(k) is not Tensor or q.dtype != k.dtype \
            or q.device != k.device or torch.compiler.is_compiling() \
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return None
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    d = q.shape[-1]
    # Strides of batch or sequence dims of size 1 are arbitrary (a view may set them either
    # way), so only the others must agree.
    if qt.shape[:2] != kt.shape[:2] or kt.shape[-1] != d \
            or any(n > 1 and a != b for n, a, b in zip(qt.shape[:2], qt.stride(), kt.stride())) \
            or qt.stride(-1) != 1 or (q.shape[1] > 1 and qt.stride(2) != d) \
            or (k.shape[1] > 1 and kt.stride(2) != d) \
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() \
            or k.storage_offset() != q.storage_offset() + q.shape[1] * d:
        return None
    return qt.as_strided((*qt.shape[:2], q.shape[1] + k.shape[1], d), (*qt.stride()[:2], d, 1))


def _fused_apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                        unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` on ``meshlab::rotary``: q (B, H, S, D),
    k (B, Hkv, S, D), cos/sin (B or 1, S, D) with equal halves."""
    from ...ops.rotary import rotary

    b, s, d = q.shape[0], q.shape[2], q.shape[-1]
    c, sn = cos[..., : d // 2], sin[..., : d // 2]
    if c.shape[0] == 1:
        c, sn = c[0], sn[0]
        both = _adjacent(q, k)
        if both is not None:        # one launch for the two, as parts of one tensor
            y = rotary(both, c, sn)
            hq = q.shape[1]
            return y[:, :, :hq].transpose(1, 2), y[:, :, hq:].transpose(1, 2)

        def rot(x):
            return rotary(x.transpose(1, 2), c, sn).transpose(1, 2)
    else:
        # Positions per sample: fold batch into sequence, one angle row per token.
        c, sn = c.reshape(b * s, -1), sn.reshape(b * s, -1)

        def rot(x):
            y = rotary(rearrange(x, "b h s d -> 1 (b s) h d"), c, sn)
            return rearrange(y, "1 (b s) h d -> b h s d", b=b)
    return rot(q), rot(k)


def _dispatcher(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not _active():
            return original(q, k, cos, sin, *args, **kwargs)
        if args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1 \
                or q.shape[-1] != cos.shape[-1]:
            raise ConfigError(
                f"{original.__module__}.apply_rotary_pos_emb was called with q "
                f"{tuple(q.shape)}, cos {tuple(cos.shape)} and extra arguments "
                f"{args or sorted(kwargs)}: rotation of part of the head, or another layout, "
                f"is not routed to meshlab::rotary; leave 'rotary' out of fuse(ops=...)")
        return _fused_apply_rotary(q, k, cos, sin)

    apply_rotary_pos_emb._meshlab_original = original
    return apply_rotary_pos_emb


def _enter(module, args, kwargs=None):
    _ROUTED.depth = getattr(_ROUTED, "depth", 0) + 1


def _leave(module, args, output):
    _ROUTED.depth -= 1


def _find_rotary(model: nn.Module) -> list[tuple[str, nn.Module, types.ModuleType]]:
    """``(name, module, modeling module)`` of each attention module whose modeling file has
    an ``apply_rotary_pos_emb``; each such function not dispatched yet is probed once."""
    found, probed = [], set()
    for name, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or not type(m).__name__.endswith("Attention"):
            continue
        if not getattr(m, "_meshlab_rotary", False) and \
                not hasattr(fn, "_meshlab_original") and fn not in probed:
            _probe_rotary(fn, type(m).__name__)
            probed.add(fn)
        found.append((name, m, mod))
    return found


def _route_rotary(model: nn.Module, found) -> list[str]:
    for _, m, mod in found:
        if getattr(m, "_meshlab_rotary", False):                # routed before
            continue
        fn = mod.apply_rotary_pos_emb
        if not hasattr(fn, "_meshlab_original"):
            setattr(mod, "apply_rotary_pos_emb", _dispatcher(fn))
        m.register_forward_pre_hook(_enter)
        m.register_forward_hook(_leave, always_call=True)
        m._meshlab_rotary = True
    return [name for name, _, _ in found]


def _probe_rotary(fn, owner: str) -> None:
    params = inspect.signature(fn).parameters
    if list(params)[:4] != ["q", "k", "cos", "sin"]:
        raise ConfigError(f"{fn.__module__}.apply_rotary_pos_emb{inspect.signature(fn)} "
                          f"(used by {owner}) is not (q, k, cos, sin, ...); leave 'rotary' out "
                          f"of fuse(ops=...)")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    ang = torch.randn(2, 5, 4, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    for c, s in ((cos, sin), (cos[:1], sin[:1])):
        try:
            want = fn(q, k, c, s)
        except Exception as e:          # e.g. a GPU-only kernel patched in by another library
            raise ConfigError(
                f"the apply_rotary_pos_emb that {owner} calls ({fn.__module__}."
                f"{fn.__qualname__}) failed on a CPU probe ({type(e).__name__}: "
                f"{str(e)[:120]}); if another library patched the modeling module, build the "
                f"model in a fresh process, or leave 'rotary' out of fuse(ops=...)") from e
        got = _fused_apply_rotary(q, k, c, s)
        for a, b in zip(got, want):
            probe_close(a, b, f"{fn.__module__}.apply_rotary_pos_emb",
                         "leave 'rotary' out of fuse(ops=...)")
