"""The kernels ``meshlab::attention`` runs on CUDA, and the grouping of kv heads they and
the reference share.

cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` and its backward),
called directly so that it hands back ``lse``, takes grouped kv heads and strided views as
they are and writes its output and gradients in its inputs' layout. Where cuDNN cannot run
(float32, a GPU before sm80, or cuDNN refusing the shape, remembered per shape) PyTorch's
memory-efficient kernel runs instead, on kv heads repeated to ``Hq`` whose gradients are
summed back. Each call records the path it took in ``_build.LAST_PATH``.

Segment-masked calls (packed and padded batches: query ``i`` sees key ``j`` only where
their segment ids are equal) run the memory-efficient kernel with the segment mask (and
the causal one) as an explicit additive bias, 0 where a key is seen and -inf where not,
laid out as SDPA lays a mask out for it (rows 16-aligned); cuDNN is not given masks.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import _build


def _expand(t: Tensor, group: int) -> Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * group, S, D), each kv head repeated for its query heads."""
    if group == 1:
        return t
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, group, s, d).reshape(b, h * group, s, d)


def _reduce(t: Tensor, group: int) -> Tensor:
    """(B, Hkv * group, S, D) -> (B, Hkv, S, D), summing each group's query-head gradients."""
    if group == 1:
        return t
    b, h, s, d = t.shape
    acc = torch.promote_types(t.dtype, torch.float32)
    return t.view(b, h // group, group, s, d).sum(2, dtype=acc).to(t.dtype)



# (device index, dtype, D, causal) -> why cuDNN refused it; such calls go straight to the
# memory-efficient kernel instead of failing in cuDNN every time.
_CUDNN_REFUSED: dict[tuple, str] = {}


def _cudnn_unusable(q: Tensor, causal: bool) -> str | None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN SDPA needs float16/bfloat16, got {str(q.dtype).removeprefix('torch.')}"
    idx = q.device.index
    major, minor = _capability(torch.cuda.current_device() if idx is None else idx)
    if major < 8:
        return f"cuDNN SDPA needs sm80 or newer, this GPU is sm{major}{minor}"
    return _CUDNN_REFUSED.get(_cudnn_key(q, causal))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_ZEROS: dict[torch.device, Tensor] = {}


def _zero(device: torch.device) -> Tensor:
    """A 0-d int64 zero on ``device`` (the unused philox seed and offset), made once."""
    z = _ZEROS.get(device)
    if z is None:
        z = _ZEROS[device] = torch.zeros((), dtype=torch.long, device=device)
    return z


def _cudnn_key(q: Tensor, causal: bool) -> tuple:
    return (q.device.index, q.dtype, q.shape[-1], causal)


@functools.cache
def _cudnn_lse_rank() -> int:
    """Rank of the lse cuDNN's forward returns in this torch build: (B, H, S, 1) or (B, H, S).
    Read from the op's meta kernel, which is written to match the CUDA one."""
    t = torch.empty(1, 1, 2, 8, device="meta", dtype=torch.bfloat16)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        t, t, t, None, True, 0.0, False, False, scale=1.0)[1].dim()


def _efficient_lse_len(s: int) -> int:
    """Length of the memory-efficient kernel's lse rows: padded to a multiple of 32 on CUDA
    (as its meta kernel says), exactly ``s`` on ROCm."""
    return s if torch.version.hip else -(-s // 32) * 32


def _cudnn_fwd(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    b, h, s, _ = q.shape
    return out, lse.reshape(b, h, s)                               # (B, H, S, 1) -> (B, H, S)


def _bshd(t: Tensor) -> Tensor:
    """``t`` (B, H, S, D) laid out as (B, S, H, D) memory (a no-op for such a view)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _cudnn_bwd(dout, q, k, v, out, lse, causal, scale):
    s, skv = q.shape[2], k.shape[2]
    lse_native = lse.unsqueeze(-1) if _cudnn_lse_rank() == 4 else lse
    # cuDNN's backward reads out and dout with one layout: given a contiguous out (what the
    # custom op returns for contiguous queries) and a dout laid out otherwise (the
    # transpose Hugging Face hands back), it returns wrong gradients without an error. Both
    # go in as the (B, S, H, D) memory its forward writes for such inputs; with Hugging
    # Face's queries they already are.
    out, dout = _bshd(out), _bshd(dout)
    # Dropout is off, so the philox seed and offset are never read; cum_seq_q/k are None for
    # dense (not nested) tensors, as the forward returns them.
    zero = _zero(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse_native, zero, zero, None, None, None, s, skv, 0.0, causal,
        scale=scale)
    return dq, dk, dv


def _efficient_fwd(q, k, v, causal, scale):
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    # out is a (B, H, S, D) view of (B, S, H, D) memory, as Hugging Face's queries are (the
    # op lays it out as its queries, ``_layout``); lse rows are padded (see above).
    return out, lse[..., :q.shape[2]].contiguous()


def _efficient_bwd(dout, q, k, v, out, lse, causal, scale):
    s = q.shape[2]
    # The kernel reads out as (B, S, H, D) memory (its row stride is H * D), as its forward
    # wrote it; the op's out is laid out as its queries, which may be otherwise.
    out_bshd = _bshd(out)
    pad = _efficient_lse_len(s) - s
    lse_native = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    zero = _zero(q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out_bshd, lse_native, zero, zero, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, dk, dv


def _cuda_call(op: str, q: Tensor, causal: bool, cudnn, efficient):
    """Run ``cudnn()``, or ``efficient()`` where cuDNN cannot, and record which ran."""
    why = _cudnn_unusable(q, causal)
    if why is None:
        try:
            res = cudnn()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # cuDNN refuses shapes it has no engine for this way
            first = str(e).strip().splitlines()
            why = f"cuDNN SDPA raised {first[0][:160] if first else type(e).__name__}"
            _CUDNN_REFUSED[_cudnn_key(q, causal)] = why
        else:
            _build.record(op, "cuda", True, "cuDNN SDPA (aten._scaled_dot_product_cudnn_attention)")
            return res
    res = efficient()
    _build.record(op, "cuda", True, f"memory-efficient SDPA, as {why}")
    return res


def segment_bias(q: Tensor, k: Tensor, causal: bool, qseg: Tensor, kseg: Tensor) -> Tensor:
    """(B, Hq, S, Skv) additive bias in q's dtype, 0 where a key is seen, -inf elsewhere: the
    segment mask (and the causal one), its rows padded to 16 elements as the
    memory-efficient kernel reads them (a view of the first Skv columns, heads expanded)."""
    b, h, s, _ = q.shape
    skv = k.shape[2]
    seen = qseg[:, None, :, None] == kseg[:, None, None, :]
    if causal:
        seen = seen & torch.ones(s, skv, dtype=torch.bool, device=q.device).tril()
    wide = -(-skv // 16) * 16
    bias = torch.zeros(b, 1, s, wide, dtype=q.dtype, device=q.device)
    bias[..., :skv].masked_fill_(~seen, float("-inf"))
    return bias[..., :skv].expand(b, h, s, skv)


def _segmented_forward(q, k, v, causal, scale, qseg, kseg):
    group = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, group).contiguous(), _expand(v, group).contiguous()
    bias = segment_bias(q, k, causal, qseg, kseg)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), ke, ve, bias, True, 0.0, False, scale=scale)
    _build.record("attention", "cuda", True, "memory-efficient SDPA with the segment mask")
    return out, lse[..., :q.shape[2]].contiguous()


def _segmented_backward(dout, q, k, v, out, lse, causal, scale, qseg, kseg):
    group = q.shape[1] // k.shape[1]
    s = q.shape[2]
    ke, ve = _expand(k, group).contiguous(), _expand(v, group).contiguous()
    bias = segment_bias(q, k, causal, qseg, kseg)
    pad = _efficient_lse_len(s) - s
    lse_native = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    zero = _zero(q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), ke, ve, bias, _bshd(out), lse_native,
        zero, zero, 0.0, [True, True, True, False], False, scale=scale)
    _build.record("attention_backward", "cuda", True,
                  "memory-efficient SDPA with the segment mask")
    return dq, _reduce(dk, group), _reduce(dv, group)


def cuda_forward(q, k, v, causal, scale, qseg=None, kseg=None):
    if qseg is not None:
        return _segmented_forward(q, k, v, causal, scale, qseg, kseg)
    # cuDNN takes grouped kv heads and strided (B, H, S, D) views as they are (Hugging Face
    # hands over transposes of (B, S, H, D) projections), so nothing is copied for it; the
    # memory-efficient kernel gets kv heads repeated and contiguous inputs.
    group = q.shape[1] // k.shape[1]

    def efficient():
        ke, ve = _expand(k, group).contiguous(), _expand(v, group).contiguous()
        return _efficient_fwd(q.contiguous(), ke, ve, causal, scale)

    return _cuda_call("attention", q, causal, lambda: _cudnn_fwd(q, k, v, causal, scale),
                      efficient)


def cuda_backward(dout, q, k, v, out, lse, causal, scale, qseg=None, kseg=None):
    if qseg is not None:
        return _segmented_backward(dout, q, k, v, out, lse.float().contiguous(), causal, scale,
                                   qseg, kseg)
    group = q.shape[1] // k.shape[1]
    dout, lse = dout.to(q.dtype), lse.float().contiguous()

    def efficient():
        ke, ve = _expand(k, group).contiguous(), _expand(v, group).contiguous()
        dq, dk, dv = _efficient_bwd(dout.contiguous(), q.contiguous(), ke, ve, out, lse,
                                    causal, scale)
        return dq, _reduce(dk, group), _reduce(dv, group)

    return _cuda_call("attention_backward", q, causal,
                      lambda: _cudnn_bwd(dout, q, k, v, out, lse, causal, scale), efficient)
