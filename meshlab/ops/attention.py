"""Scaled dot-product attention, fused: ``softmax(q @ k.T * scale [+ causal mask]) @ v``.

Layout as ``torch.nn.functional.scaled_dot_product_attention``: ``q`` is (B, Hq, S, D), ``k``
and ``v`` are (B, Hkv, Skv, D), the output (B, Hq, S, D) in ``q.dtype``. ``Hq`` must be a
multiple of ``Hkv`` (grouped-query attention): query head ``h`` attends with kv head
``h // (Hq // Hkv)``. ``causal=True`` masks as SDPA's ``is_causal`` does, aligned top-left
(query ``i`` sees keys ``j <= i``), and needs ``S == Skv``. ``scale`` defaults to
``1 / sqrt(D)``. Packed and padded batches: ``segments`` (B, S) and ``kv_segments``
(B, Skv), integer ids (``kv_segments`` defaults to ``segments`` when ``S == Skv``), let
query ``i`` of row ``b`` see key ``j`` only where ``segments[b, i] == kv_segments[b, j]``
(and, causal, ``j <= i``): each packed sample a segment, each padding token one of its
own. A row that sees no key gets 0 and ``lse`` -inf. There is no dropout and no other
mask (sliding window, bias): such calls need SDPA or flex attention.

Registered as ``meshlab::attention``, which returns the output and the float32
log-sum-exp of each row of scaled scores, ``lse`` (B, Hq, S), and
``meshlab::attention_backward``, which recomputes the probabilities from ``lse`` (the
S x Skv matrix is never stored); ``dk``/``dv`` are summed over the query heads sharing a kv
head. Paths, each recorded in ``_build.LAST_PATH[("attention", device)]``:

* CPU, float32 or bfloat16: the C++ kernel in ``csrc/attention_cpu.cpp`` (tiles of 64
  queries x 64 keys, online softmax, float32 accumulation, OpenMP; with segments, tile
  pairs whose segment ids cannot meet are skipped).
* CUDA, the training pass (a graph recorded for the backward) of :func:`attention` on
  plain float16/bfloat16 tensors at head dim 64 or 128 where flash-attn-4 runs (a Hopper
  card): flash-attn-4's ``flash_attn_func``, eagerly with its own autograd; under
  ``torch.compile`` (``FA4_COMPILED``, on) through ``meshlab::flash_attention_4``
  and its backward, ops that hold the same two kernels where a graph cannot trace
  flash-attn-4's Python entry point.
* CUDA, :func:`attention` on plain tensors in float16/bfloat16 with ``D <= 256`` and the
  ``flash_attn`` package importable: ``flash_attn.flash_attn_func`` (its own autograd);
  with segments, flash-attn-4's or FlashAttention-2's ``flash_attn_varlen_func`` where
  every row's segments are contiguous runs (:func:`_varlen`), else the op below.
* CUDA with segments (``_attention_cuda``): PyTorch's memory-efficient kernel with the
  segment mask as an explicit boolean mask (cuDNN is not given masks).
* CUDA otherwise (``_attention_cuda``): cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``
  and its backward), called directly so that it hands back ``lse``; where cuDNN cannot run
  (float32, a GPU before sm80, or cuDNN refusing the shape) PyTorch's memory-efficient
  kernel (``aten._scaled_dot_product_efficient_attention``), the reason recorded. Both are
  given the kv heads repeated to ``Hq``, and the kv gradients are summed back over groups.
* Anything else (float16 on CPU, ``MESHLAB_OPS_NATIVE=0``, no compiler): the float32 math
  of :func:`attention_reference`, recorded as a fallback with the reason.

DTensor: ``q``, ``k``, ``v`` replicated, or all sharded on batch (dim 0, the segment ids
too), or all on heads (dim 1, the segment ids replicated; each shard then needs whole
groups, i.e. ``Hkv`` divisible by the mesh size).
Never on sequence: every query needs every key (ring or Ulysses attention do that).

:func:`hf_attention` is the same op behind transformers' ``AttentionInterface`` and
:func:`register_hf` registers it as ``attn_implementation="meshlab"``; it reads the
segments of a padded or packed batch from the 4-D mask transformers hands it
(:func:`causal_segments`); those three live in ``_attention_hf``.

>>> import torch
>>> from meshlab.ops import attention
>>> q, k, v = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
>>> attention(q, k, v, causal=True).shape
torch.Size([2, 4, 10, 16])
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..core.errors import ConfigError
from . import _build
from ._attention_cuda import _expand, _reduce, cuda_backward, cuda_forward

HF_NAME = "meshlab"


# ---------------------------------------------------------------------------- checks

def _check(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """Raise before anything runs when q, k, v do not fit together."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"meshlab attention: q must be (B, Hq, S, D) and k, v (B, Hkv, Skv, D) "
                         f"as in torch SDPA, got {shapes}; for (B, S, H, D) tensors pass "
                         f"x.transpose(1, 2)")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"meshlab attention: k and v must have one shape (B, Hkv, Skv, D), "
                         f"got {shapes}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"meshlab attention: q and k/v must have the same batch size B, got "
                         f"{shapes}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"meshlab attention: q and k/v must have the same head dim D, got "
                         f"{shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"meshlab attention: the number of query heads Hq={q.shape[1]} must be "
                         f"a multiple of the kv heads Hkv={k.shape[1]} (grouped-query "
                         f"attention), got {shapes}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"meshlab attention: causal=True needs S == Skv (the mask is aligned "
                         f"top-left, as SDPA's is_causal), got S={q.shape[2]}, "
                         f"Skv={k.shape[2]} ({shapes}); a single decoding query that sees "
                         f"the whole cache is causal=False")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"meshlab attention: q, k and v must share one dtype, got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}; cast them first")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"meshlab attention: q, k and v must be on one device, got "
                         f"{q.device}, {k.device}, {v.device}")


def _segments(q: Tensor, k: Tensor, segments: Tensor | None,
              kv_segments: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """The query and key segment ids, checked against q and k: (None, None) without them,
    else two (B, S) / (B, Skv) integer tensors (``kv_segments`` defaults to ``segments``)."""
    if segments is None:
        if kv_segments is not None:
            raise ValueError("meshlab attention: kv_segments without segments; pass the "
                             "query segment ids too")
        return None, None
    if kv_segments is None:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"meshlab attention: segments alone need S == Skv, got "
                             f"S={q.shape[2]}, Skv={k.shape[2]}; pass kv_segments (B, Skv)")
        kv_segments = segments
    for name, t, n in (("segments", segments, q.shape[2]), ("kv_segments", kv_segments,
                                                            k.shape[2])):
        if not isinstance(t, Tensor) or t.dim() != 2 or tuple(t.shape) != (q.shape[0], n) \
                or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            got = f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}" \
                if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"meshlab attention: {name} must be an integer tensor "
                             f"(B, {'S' if name == 'segments' else 'Skv'}) = "
                             f"({q.shape[0]}, {n}), got {got}")
        if t.device != q.device:
            raise ValueError(f"meshlab attention: {name} must be on q's device {q.device}, "
                             f"got {t.device}")
    return segments, kv_segments


def _visible(s: Tensor, causal: bool, qseg: Tensor | None, kseg: Tensor | None) -> Tensor | None:
    """Which keys each query sees, broadcastable to the scores ``s`` (B, Hq, S, Skv); None
    where every key is seen."""
    seen = None
    if causal:
        seen = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if qseg is not None:
        same = (qseg[:, None, :, None] == kseg[:, None, None, :])
        seen = same if seen is None else same & seen
    return seen


def _default_scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# ---------------------------------------------------------------------------- reference

def attention_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                        scale: float | None = None, segments: Tensor | None = None,
                        kv_segments: Tensor | None = None) -> Tensor:
    """Pure-PyTorch attention, float32 math. q: (B, Hq, S, D), k, v: (B, Hkv, Skv, D) ->
    (B, Hq, S, D) in q.dtype. kv heads are repeated (``repeat_interleave``) to Hq. With
    ``segments``, a query sees the keys of its own segment only (a row that sees none
    gives 0)."""
    _check(q, k, v, causal)
    qseg, kseg = _segments(q, k, segments, kv_segments)
    scale = _default_scale(q, scale)
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = _build.upcast(q), _build.upcast(k), _build.upcast(v)
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    seen = _visible(s, causal, qseg, kseg)
    if seen is None:
        return (torch.softmax(s, dim=-1) @ vf).to(q.dtype)
    s = s.masked_fill(~seen, float("-inf"))
    # a row that sees no key: 0, not the NaN of an empty softmax
    p = torch.softmax(s, dim=-1).nan_to_num(0.0) if qseg is not None else torch.softmax(s, -1)
    return (p @ vf).to(q.dtype)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, qseg: Tensor | None = None,
            kseg: Tensor | None = None) -> Tensor:
    """Scaled, masked scores (B, Hq, S, Skv) in float32 (float64 for float64 inputs)."""
    return _masked_scores(q, k, causal, scale, qseg, kseg)[0]


def _masked_scores(q: Tensor, k: Tensor, causal: bool, scale: float, qseg: Tensor | None,
                   kseg: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """:func:`_scores` and which keys each query sees (None: all)."""
    group = q.shape[1] // k.shape[1]
    s = (_build.upcast(q) @ _expand(_build.upcast(k), group).transpose(-1, -2)) * scale
    seen = _visible(s, causal, qseg, kseg)
    if seen is not None:
        s = s.masked_fill(~seen, float("-inf"))
    return s, seen


def _probs(s: Tensor, seen: Tensor | None, lse: Tensor) -> Tensor:
    """exp(s - lse), 0 where a key is not seen (also on a row that sees none, lse -inf)."""
    p = torch.exp(s - lse[..., None])
    return p if seen is None else p.masked_fill(~seen, 0.0)


def _fwd_torch(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
               qseg: Tensor | None = None, kseg: Tensor | None = None) -> tuple[Tensor, Tensor]:
    s, seen = _masked_scores(q, k, causal, scale, qseg, kseg)
    lse = torch.logsumexp(s, dim=-1)                                        # (B, Hq, S)
    p = _probs(s, seen, lse)
    out = p @ _expand(_build.upcast(v), q.shape[1] // k.shape[1])
    return out.to(q.dtype), lse.to(_build.stat_dtype(q))


def _bwd_torch(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               causal: bool, scale: float, qseg: Tensor | None = None,
               kseg: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    group = q.shape[1] // k.shape[1]
    s, seen = _masked_scores(q, k, causal, scale, qseg, kseg)
    p = _probs(s, seen, lse.to(s.dtype))                                    # (B, Hq, S, Skv)
    g, o = _build.upcast(dout), _build.upcast(out)
    kf, vf = _expand(_build.upcast(k), group), _expand(_build.upcast(v), group)
    ds = p * (g @ vf.transpose(-1, -2) - (g * o).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = _reduce((ds.transpose(-1, -2) @ _build.upcast(q)) * scale, group)
    dv = _reduce(p.transpose(-1, -2) @ g, group)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _long(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.to(torch.long).contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
             qseg: Tensor | None = None, kseg: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) on the best path for the device; out may be strided on CUDA."""
    if q.device.type == "cuda":
        off = _build.native_disabled_reason()
        if off is None:
            return cuda_forward(q, k, v, causal, scale, qseg, kseg)
        _build.record("attention", "cuda", False, off)
        return _fwd_torch(q, k, v, causal, scale, qseg, kseg)
    mod = _build.kernels("attention", q)
    if mod is None:
        return _fwd_torch(q, k, v, causal, scale, qseg, kseg)
    return mod.attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale,
                             _long(qseg), _long(kseg))


def _backward_impl(dout, q, k, v, out, lse, causal, scale, qseg=None,
                   kseg=None) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        off = _build.native_disabled_reason()
        if off is None:
            return cuda_backward(dout, q, k, v, out, lse, causal, scale, qseg, kseg)
        _build.record("attention_backward", "cuda", False, off)
        return _bwd_torch(dout, q, k, v, out, lse, causal, scale, qseg, kseg)
    mod = _build.kernels("attention_backward", q)
    if mod is None:
        return _bwd_torch(dout, q, k, v, out, lse, causal, scale, qseg, kseg)
    c = [t.to(q.dtype).contiguous() for t in (dout, q, k, v, out)]
    return mod.attention_bwd(*c, lse.float().contiguous(), causal, scale, _long(qseg),
                             _long(kseg))


# ---------------------------------------------------------------------------- custom ops

def _layout(t: Tensor, ref: Tensor) -> Tensor:
    """An output as the op's fake promises it (``_empty(ref)``). On CUDA: in its input's
    layout, which is how cuDNN writes its output and gradients, so with Hugging Face's
    (B, S, H, D)-ordered queries nothing is copied and the transpose back to (B, S, H * D)
    is a view, compiled as eagerly. (Under a contiguous promise the compiled TinyLlama step
    on the H200 made 7 strided copies a layer, 10.4 ms of 216, and inductor one more for
    that transpose; the eager step, which skips the custom op, made none.) On the CPU:
    contiguous, as the C++ kernels write them."""
    return _build.like(t, ref) if ref.device.type == "cuda" else _build.contiguous(t)


def _empty(ref: Tensor) -> Tensor:
    return torch.empty_like(ref) if ref.device.type == "cuda" else ref.new_empty(ref.shape)


@torch.library.custom_op("meshlab::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                 segments: Tensor | None = None,
                 kv_segments: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q (B, Hq, S, D), k, v (B, Hkv, Skv, D), optional integer segment ids (B, S) and
    (B, Skv) -> (out (B, Hq, S, D) in q.dtype, laid out as ``_layout`` says; lse (B, Hq, S)
    float32 (float64 for float64 q), contiguous, the log-sum-exp of each row of scaled,
    masked scores, -inf on a row that sees no key)."""
    _check(q, k, v, causal)
    qseg, kseg = _segments(q, k, segments, kv_segments)
    out, lse = _forward(q, k, v, causal, scale, qseg, kseg)
    return _layout(out, q), _build.contiguous(lse)


@attention_op.register_fake
def _(q, k, v, causal, scale, segments=None, kv_segments=None):
    _check(q, k, v, causal)
    _segments(q, k, segments, kv_segments)
    return _empty(q), q.new_empty(q.shape[:-1], dtype=_build.stat_dtype(q))


@torch.library.custom_op("meshlab::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       causal: bool, scale: float, segments: Tensor | None = None,
                       kv_segments: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dout, q, out (B, Hq, S, D), k, v (B, Hkv, Skv, D), lse (B, Hq, S) float32, the
    forward's segment ids -> (dq (B, Hq, S, D), dk, dv (B, Hkv, Skv, D)), each laid out as
    ``_layout`` says for q, k and v, in their dtypes."""
    qseg, kseg = _segments(q, k, segments, kv_segments)
    dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, causal, scale, qseg, kseg)
    return _layout(dq, q), _layout(dk, k), _layout(dv, v)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, segments=None, kv_segments=None):
    return _empty(q), _empty(k), _empty(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, *segs = inputs
    qseg, kseg = (segs + [None, None])[:2]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, qseg, kseg)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, qseg, kseg = ctx.saved_tensors
    dq, dk, dv = torch.ops.meshlab.attention_backward(dout, q, k, v, out, lse, ctx.causal,
                                                      ctx.scale, qseg, kseg)
    return dq, dk, dv, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same kernels without the custom op's dispatch, for plain tensors in eager mode
    (and without forcing outputs contiguous, which the custom op's fake promises)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, qseg=None, kseg=None):
        out, lse = _forward(q, k, v, causal, scale, qseg, kseg)
        ctx.save_for_backward(q, k, v, out, lse, qseg, kseg)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, qseg, kseg = ctx.saved_tensors
        dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, ctx.causal, ctx.scale, qseg,
                                    kseg)
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------------------- public

@functools.cache
def _flash_attn():
    """The ``flash_attn`` module, or ``None`` where it is not installed. An installed one that
    fails to import raises: it would otherwise be skipped without a word."""
    try:
        import flash_attn
    except ModuleNotFoundError as e:
        if e.name == "flash_attn":
            return None
        raise ImportError(f"flash_attn is installed but cannot be imported ({e}); install what "
                          f"it needs, or uninstall flash-attn (attention then runs on cuDNN)") \
            from e
    except ImportError as e:
        raise ImportError(f"flash_attn is installed but cannot be imported ({e}), most likely "
                          f"built for another torch or CUDA; reinstall it, or uninstall "
                          f"flash-attn (attention then runs on cuDNN)") from e
    # flash-attn-4 alone installs flash_attn/cute and no FlashAttention-2 entry point.
    return flash_attn if hasattr(flash_attn, "flash_attn_func") else None


@functools.cache
def _flash_attn_4():
    """``(flash_attn.cute.flash_attn_func, version)`` where flash-attn-4 is installed and
    this is a Hopper card, else ``None``. An installed one that fails to import raises."""
    return _build.hopper_package("flash_attn.cute", "flash-attn-4", "flash_attn_func",
                                 "attention then runs on cuDNN")


# flash-attn-4 takes the training pass (forward and backward) at these head dims: measured
# on the H200 against cuDNN (benchmarks/results/attention_fa4_h200*.json, two runs), causal
# GQA in bf16, forward+backward 1.07x at head dim 64 and 8 x 2048 tokens, 1.18x at 2 x 8192,
# even at head dim 128 and 8 x 2048, 1.06x at 2 x 8192. Its forward alone is slower at head
# dim 64 (0.50 against 0.39-0.44 ms) and at 128 and 8 x 2048 (0.71 against 0.57 ms), so a
# pass that records no graph (inference, prefill) stays on cuDNN.
_FA4_HEAD_DIMS = (64, 128)


@functools.cache
def _flash_attn_4_varlen():
    """flash-attn-4's ``flash_attn_varlen_func`` where :func:`_flash_attn_4` runs, else None."""
    if _flash_attn_4() is None:
        return None
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def _varlen(segments: Tensor, kv_segments: Tensor | None) -> tuple[Tensor, int] | None:
    """``(cu_seqlens int32 (runs + 1,), longest run)`` of the (B * S) tokens as
    flash-attention's varlen functions take them, where each row's segments are runs of
    consecutive tokens (no id in two runs of a row, so one sequence a run is exactly the
    segment mask) and the keys' segments are the queries'; else None (reads the ids on the
    host)."""
    if kv_segments is not None and kv_segments is not segments and \
            not torch.equal(kv_segments, segments):
        return None
    b, s = segments.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=segments.device)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    rows = torch.arange(b, device=segments.device)[:, None].expand(b, s)
    keys = torch.stack([rows[starts], segments.to(torch.long)[starts]])
    if torch.unique(keys, dim=1).shape[1] != keys.shape[1]:
        return None                     # a segment split into runs (a token masked inside)
    where = starts.flatten().nonzero().flatten()
    cu = torch.cat([where, where.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _training_pass(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether this call is one flash-attn-4 takes: a head dim it was measured faster at,
    and a graph recorded for the backward."""
    return q.shape[-1] in _FA4_HEAD_DIMS and torch.is_grad_enabled() and \
        any(t.requires_grad for t in (q, k, v))


def _fa4_for(q: Tensor, k: Tensor, v: Tensor):
    return _flash_attn_4() if _training_pass(q, k, v) else None


@functools.cache
def _flash_attn_4_backward():
    """flash-attn-4's backward entry (``flash_attn.cute.interface._flash_attn_bwd``, which
    its own autograd calls: ``(dq, dk, dv)`` of ``(q, k, v, out, dout, lse, scale, causal)``
    in its (B, S, H, D) layout) where :func:`_flash_attn_4` runs and this version has it,
    else None."""
    if _flash_attn_4() is None:
        return None
    from flash_attn.cute import interface

    return getattr(interface, "_flash_attn_bwd", None)


# Whether compiled graphs take flash-attn-4 (``meshlab::flash_attention_4``) where it runs.
# tests/ops/test_attention_gpu.py::test_compiled_training_pass_takes_flash_attn_4 passes on
# an H100; there compiled blocks on it took 0.980x the step time of compiled blocks on
# cuDNN, interleaved over 20 steps at the TinyLlama shape (benchmarks/results/
# single_gpu_tinyllama_pair_meshlab_blocks_meshlab_blocks_fa4_fa4vs_nvidia_h100_80gb_hbm3.json).
FA4_COMPILED = True


@torch.compiler.assume_constant_result
def _fa4_compiles() -> bool:
    """Whether ``meshlab::flash_attention_4`` can run here (flash-attn-4 with its backward
    entry, on Hopper) and compiled graphs take it (``FA4_COMPILED``): read once, a
    constant to ``torch.compile``, which would otherwise trace the import."""
    return FA4_COMPILED and _flash_attn_4_backward() is not None


def _t(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


def _bshd(t: Tensor) -> Tensor:
    """On CUDA, (B, H, S, D) ``t`` in (B, S, H, D) memory, the layout flash-attn-4 writes its
    output and gradients in and Hugging Face's projections hand over: so returned from it
    as they are, no copy (a promise of ``q``'s layout copied each of them where ``q`` came
    (B, H, S, D)-contiguous, as a compiled rotary hands it over). On the CPU contiguous, as
    every op's outputs there."""
    return _t(_build.contiguous(_t(t))) if t.device.type == "cuda" else _build.contiguous(t)


def _bshd_empty(ref: Tensor) -> Tensor:
    if ref.device.type != "cuda":
        return ref.new_empty(ref.shape)
    b, h, s, d = ref.shape
    return _t(ref.new_empty(b, s, h, d))


@torch.library.custom_op("meshlab::flash_attention_4", mutates_args=())
def flash_attention_4(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                      scale: float) -> tuple[Tensor, Tensor]:
    """flash-attn-4's forward as an op a compiled graph can hold (its Python entry point
    cannot be traced): q (B, Hq, S, D), k, v (B, Hkv, Skv, D) -> (out (B, Hq, S, D) in
    (B, S, Hq, D) memory (:func:`_bshd`), lse (B, Hq, S) as ``meshlab::attention``'s). The training pass of
    :func:`attention` under ``torch.compile``, where the eager pass calls flash-attn-4
    itself. Where flash-attn-4 does not run, the same math on ``meshlab::attention``'s
    kernels (its forward and backward both, the path recorded)."""
    if _flash_attn_4_backward() is None:
        out, lse = _forward(q, k, v, causal, scale)
    else:
        fn, ver = _flash_attn_4()
        _build.record("attention", "cuda", True,
                      f"flash-attn-4 {ver} (training pass, compiled)")
        out, lse = fn(_t(q), _t(k), _t(v), softmax_scale=scale, causal=causal,
                      return_lse=True)
        out = _t(out)
    return _bshd(out), _build.contiguous(lse)


@flash_attention_4.register_fake
def _(q, k, v, causal, scale):
    _check(q, k, v, causal)
    return _bshd_empty(q), q.new_empty(q.shape[:-1], dtype=_build.stat_dtype(q))


@torch.library.custom_op("meshlab::flash_attention_4_backward", mutates_args=())
def flash_attention_4_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                               lse: Tensor, causal: bool,
                               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """flash-attn-4's backward of :func:`flash_attention_4` -> (dq, dk, dv), each in
    (B, S, H, D) memory (:func:`_bshd`)."""
    bwd = _flash_attn_4_backward()
    if bwd is None:
        grads = _backward_impl(dout, q, k, v, out, lse, causal, scale)
    else:
        grads = map(_t, bwd(_t(q), _t(k), _t(v), _t(out), _t(dout), lse, scale, causal))
    return tuple(_bshd(g) for g in grads)


@flash_attention_4_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale):
    return _bshd_empty(q), _bshd_empty(k), _bshd_empty(v)


def _fa4_setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _fa4_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.meshlab.flash_attention_4_backward(dout, q, k, v, out, lse,
                                                              ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attention_4.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)


def _is_plain(t: Tensor) -> bool:
    # DTensors go through meshlab::attention, whose sharding rule flash-attn does not have.
    if not _build.sharding_available():
        return True
    from torch.distributed.tensor import DTensor

    return not isinstance(t, DTensor)


def _varlen_attention(q, k, v, causal, scale, segments, kv_segments) -> Tensor | None:
    """Segment-masked attention through flash-attention's varlen entry (flash-attn-4 where
    it takes the training pass, else FlashAttention-2), one sequence a segment run; None
    where neither is installed or the segments are not runs (:func:`_varlen`)."""
    fa4 = _fa4_for(q, k, v)
    fn = _flash_attn_4_varlen() if fa4 is not None else None
    name = f"flash-attn-4 {fa4[1]} varlen (training pass)" if fn is not None else None
    if fn is None:
        fa = _flash_attn()
        fn = getattr(fa, "flash_attn_varlen_func", None) if fa is not None else None
        name = f"flash-attn {fa.__version__} varlen" if fn is not None else None
    if fn is None or q.shape[2] != k.shape[2]:
        return None
    runs = _varlen(segments, kv_segments)
    if runs is None:
        return None
    cu, longest = runs
    b, h, s, d = q.shape
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], d)   # noqa: E731
    _build.record("attention", "cuda", True, name)
    out = fn(flat(q), flat(k), flat(v), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
             max_seqlen_k=longest, softmax_scale=scale, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    return out.view(b, s, h, d).transpose(1, 2)


def _cuda_half(q: Tensor) -> bool:
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def _compiled_fa4(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a call traced by ``torch.compile`` takes ``meshlab::flash_attention_4``: the
    training pass of plain half-precision CUDA tensors where flash-attn-4 runs, as the
    eager pass would call flash-attn-4 itself."""
    return (torch.compiler.is_compiling() and _cuda_half(q) and _fa4_compiles()
            and _build.native_disabled_reason() is None
            and all(_is_plain(t) for t in (q, k, v)) and _training_pass(q, k, v))


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
              scale: float | None = None, segments: Tensor | None = None,
              kv_segments: Tensor | None = None) -> Tensor:
    """Attention of q (B, Hq, S, D) over k, v (B, Hkv, Skv, D) -> (B, Hq, S, D) in q.dtype.

    ``Hq`` a multiple of ``Hkv``; ``causal`` masks top-left and needs ``S == Skv``; ``scale``
    defaults to ``1 / sqrt(D)``. ``segments`` (B, S) and ``kv_segments`` (B, Skv; default
    ``segments``): integer ids, a query sees only the keys of its own segment (packed
    samples, padding tokens each a segment of its own); a row that sees no key gives 0. No
    dropout, no other mask. Raises ``ValueError`` (``TypeError`` for mixed dtypes) before
    running anything when the shapes do not fit.
    """
    _check(q, k, v, causal)
    segments, kv_segments = _segments(q, k, segments, kv_segments)
    scale = _default_scale(q, scale)
    # Under torch.compile the custom op runs (its fake kernel is what the graph needs);
    # flash-attn's Python entry point cannot be traced, and importing it breaks the graph.
    if (_cuda_half(q) and q.shape[-1] <= 256 and not torch.compiler.is_compiling()
            and _build.native_disabled_reason() is None
            and all(_is_plain(t) for t in (q, k, v)) and segments is not None
            and _is_plain(segments) and _is_plain(kv_segments)):
        out = _varlen_attention(q, k, v, causal, scale, segments, kv_segments)
        if out is not None:
            return out
    elif (_cuda_half(q) and q.shape[-1] <= 256 and not torch.compiler.is_compiling()
            and _build.native_disabled_reason() is None
            and all(_is_plain(t) for t in (q, k, v)) and segments is None):
        fa4 = _fa4_for(q, k, v)
        if fa4 is not None:
            fn, ver = fa4
            _build.record("attention", "cuda", True, f"flash-attn-4 {ver} (training pass)")
            # (B, S, H, D) in and out; kv heads grouped as they are; causal top-left as S == Skv
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     softmax_scale=scale, causal=causal)
            out = out[0] if isinstance(out, tuple) else out
            return out.transpose(1, 2)
        fa = _flash_attn()
        if fa is not None:
            _build.record("attention", "cuda", True, f"flash-attn {fa.__version__}")
            # flash-attn takes (B, S, H, D), repeats kv heads itself, and its causal mask is
            # aligned bottom-right, which is top-left here since S == Skv.
            out = fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     dropout_p=0.0, softmax_scale=scale, causal=causal)
            return out.transpose(1, 2)
    elif segments is None and _compiled_fa4(q, k, v):
        return torch.ops.meshlab.flash_attention_4(q, k, v, causal, scale)[0]
    if _build.eager(q, k, v):
        return _Eager.apply(q, k, v, causal, scale, segments, kv_segments)
    return torch.ops.meshlab.attention(q, k, v, causal, scale, segments, kv_segments)[0]


# ---------------------------------------------------------------------------- DTensor

if _build.sharding_available():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def _seg_specs(segments, kv_segments, d):
        # The segment ids (B, S) follow the batch: sharded with it, replicated beside heads.
        seg = Shard(0) if d == 0 else Replicate()
        return [None if t is None else seg for t in (segments, kv_segments)]

    @register_sharding(torch.ops.meshlab.attention.default)
    def _(q, k, v, causal, scale, segments=None, kv_segments=None):
        # Batch rows and heads are independent; every query needs every key, so never the
        # sequence. lse (B, Hq, S) follows q.
        rules = [([Replicate(), Replicate()], [Replicate()] * 3 + [None, None]
                  + _seg_specs(segments, kv_segments, None))]
        for d in (0, 1):
            rules.append(([Shard(d), Shard(d)], [Shard(d)] * 3 + [None, None]
                          + _seg_specs(segments, kv_segments, d)))
        return rules

    @register_sharding(torch.ops.meshlab.attention_backward.default)
    def _(dout, q, k, v, out, lse, causal, scale, segments=None, kv_segments=None):
        rules = [([Replicate()] * 3, [Replicate()] * 6 + [None, None]
                  + _seg_specs(segments, kv_segments, None))]
        for d in (0, 1):
            rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None]
                          + _seg_specs(segments, kv_segments, d)))
        return rules
