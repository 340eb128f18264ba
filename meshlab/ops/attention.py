"""Scaled dot-product attention, fused: ``softmax(q @ k.T * scale [+ causal mask]) @ v``.

Layout as ``torch.nn.functional.scaled_dot_product_attention``: ``q`` is (B, Hq, S, D), ``k``
and ``v`` are (B, Hkv, Skv, D), the output (B, Hq, S, D) in ``q.dtype``. ``Hq`` must be a
multiple of ``Hkv`` (grouped-query attention): query head ``h`` attends with kv head
``h // (Hq // Hkv)``. ``causal=True`` masks as SDPA's ``is_causal`` does, aligned top-left
(query ``i`` sees keys ``j <= i``), and needs ``S == Skv``. ``scale`` defaults to
``1 / sqrt(D)``. There is no dropout and no arbitrary mask (padding, sliding window,
bias): such calls need SDPA or flex attention.

Registered as ``meshlab::attention``, which returns the output and the float32
log-sum-exp of each row of scaled scores, ``lse`` (B, Hq, S), and
``meshlab::attention_backward``, which recomputes the probabilities from ``lse`` (the
S x Skv matrix is never stored); ``dk``/``dv`` are summed over the query heads sharing a kv
head. Paths, each recorded in ``_build.LAST_PATH[("attention", device)]``:

* CPU, float32 or bfloat16: the C++ kernel in ``csrc/attention_cpu.cpp`` (tiles of 64
  queries x 64 keys, online softmax, float32 accumulation, OpenMP).
* CUDA, :func:`attention` on plain tensors in float16/bfloat16 with ``D <= 256`` and the
  ``flash_attn`` package importable: ``flash_attn.flash_attn_func`` (its own autograd).
* CUDA otherwise (``_attention_cuda``): cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``
  and its backward), called directly so that it hands back ``lse``; where cuDNN cannot run
  (float32, a GPU before sm80, or cuDNN refusing the shape) PyTorch's memory-efficient
  kernel (``aten._scaled_dot_product_efficient_attention``), the reason recorded. Both are
  given the kv heads repeated to ``Hq``, and the kv gradients are summed back over groups.
* Anything else (float16 on CPU, ``MESHLAB_OPS_NATIVE=0``, no compiler): the float32 math
  of :func:`attention_reference`, recorded as a fallback with the reason.

DTensor: ``q``, ``k``, ``v`` replicated, or all sharded on batch (dim 0), or all on heads
(dim 1; each shard then needs whole groups, i.e. ``Hkv`` divisible by the mesh size).
Never on sequence: every query needs every key (ring or Ulysses attention do that).

:func:`hf_attention` is the same op behind transformers' ``AttentionInterface`` and
:func:`register_hf` registers it as ``attn_implementation="meshlab"``.

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


def _default_scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


# ---------------------------------------------------------------------------- reference

def attention_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                        scale: float | None = None) -> Tensor:
    """Pure-PyTorch attention, float32 math. q: (B, Hq, S, D), k, v: (B, Hkv, Skv, D) ->
    (B, Hq, S, D) in q.dtype. kv heads are repeated (``repeat_interleave``) to Hq."""
    _check(q, k, v, causal)
    scale = _default_scale(q, scale)
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = _build.upcast(q), _build.upcast(k), _build.upcast(v)
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        seen = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~seen, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).to(q.dtype)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """Scaled, masked scores (B, Hq, S, Skv) in float32 (float64 for float64 inputs)."""
    group = q.shape[1] // k.shape[1]
    s = (_build.upcast(q) @ _expand(_build.upcast(k), group).transpose(-1, -2)) * scale
    if causal:
        seen = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~seen, float("-inf"))
    return s


def _fwd_torch(q: Tensor, k: Tensor, v: Tensor, causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)                                        # (B, Hq, S)
    p = torch.exp(s - lse[..., None])
    out = p @ _expand(_build.upcast(v), q.shape[1] // k.shape[1])
    return out.to(q.dtype), lse.float()


def _bwd_torch(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    group = q.shape[1] // k.shape[1]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.to(s.dtype)[..., None])                           # (B, Hq, S, Skv)
    g, o = _build.upcast(dout), _build.upcast(out)
    kf, vf = _expand(_build.upcast(k), group), _expand(_build.upcast(v), group)
    ds = p * (g @ vf.transpose(-1, -2) - (g * o).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = _reduce((ds.transpose(-1, -2) @ _build.upcast(q)) * scale, group)
    dv = _reduce(p.transpose(-1, -2) @ g, group)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) on the best path for the device; out may be strided on CUDA."""
    if q.device.type == "cuda":
        off = _build.native_disabled_reason()
        if off is None:
            return cuda_forward(q, k, v, causal, scale)
        _build.record("attention", "cuda", False, off)
        return _fwd_torch(q, k, v, causal, scale)
    mod = _build.kernels("attention", q)
    if mod is None:
        return _fwd_torch(q, k, v, causal, scale)
    return mod.attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)


def _backward_impl(dout, q, k, v, out, lse, causal, scale) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        off = _build.native_disabled_reason()
        if off is None:
            return cuda_backward(dout, q, k, v, out, lse, causal, scale)
        _build.record("attention_backward", "cuda", False, off)
        return _bwd_torch(dout, q, k, v, out, lse, causal, scale)
    mod = _build.kernels("attention_backward", q)
    if mod is None:
        return _bwd_torch(dout, q, k, v, out, lse, causal, scale)
    c = [t.to(q.dtype).contiguous() for t in (dout, q, k, v, out)]
    return mod.attention_bwd(*c, lse.float().contiguous(), causal, scale)


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
def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor]:
    """q (B, Hq, S, D), k, v (B, Hkv, Skv, D) -> (out (B, Hq, S, D) in q.dtype, laid out
    as ``_layout`` says; lse (B, Hq, S) float32, contiguous, the log-sum-exp of each row of
    scaled, masked scores)."""
    _check(q, k, v, causal)
    out, lse = _forward(q, k, v, causal, scale)
    return _layout(out, q), _build.contiguous(lse)


@attention_op.register_fake
def _(q, k, v, causal, scale):
    _check(q, k, v, causal)
    return _empty(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("meshlab::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dout, q, out (B, Hq, S, D), k, v (B, Hkv, Skv, D), lse (B, Hq, S) float32 ->
    (dq (B, Hq, S, D), dk, dv (B, Hkv, Skv, D)), each laid out as ``_layout`` says for q, k
    and v, in their dtypes."""
    dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, causal, scale)
    return _layout(dq, q), _layout(dk, k), _layout(dv, v)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale):
    return _empty(q), _empty(k), _empty(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.meshlab.attention_backward(dout, q, k, v, out, lse, ctx.causal,
                                                      ctx.scale)
    return dq, dk, dv, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same kernels without the custom op's dispatch, for plain tensors in eager mode
    (and without forcing outputs contiguous, which the custom op's fake promises)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = _backward_impl(dout, *ctx.saved_tensors, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


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
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None or \
            importlib.util.find_spec("flash_attn.cute") is None:
        return None
    if torch.cuda.get_device_capability() != (9, 0):
        return None
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as e:
        raise ImportError(f"flash-attn-4 is installed but cannot be imported ({e}); install "
                          f"its CuTe DSL libraries (nvidia-cutlass-dsl), or uninstall "
                          f"flash-attn-4 (attention then runs on cuDNN)") from e
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("flash-attn-4")
    except PackageNotFoundError:
        ver = "?"
    return flash_attn_func, ver


# flash-attn-4 takes the training pass (forward and backward) at these head dims: measured
# on the H200 against cuDNN (benchmarks/results/attention_fa4_h200*.json, two runs), causal
# GQA in bf16, forward+backward 1.07x at head dim 64 and 8 x 2048 tokens, 1.18x at 2 x 8192,
# even at head dim 128 and 8 x 2048, 1.06x at 2 x 8192. Its forward alone is slower at head
# dim 64 (0.50 against 0.39-0.44 ms) and at 128 and 8 x 2048 (0.71 against 0.57 ms), so a
# pass that records no graph (inference, prefill) stays on cuDNN.
_FA4_HEAD_DIMS = (64, 128)


def _fa4_for(q: Tensor, k: Tensor, v: Tensor):
    if q.shape[-1] not in _FA4_HEAD_DIMS or not torch.is_grad_enabled() or \
            not any(t.requires_grad for t in (q, k, v)):
        return None
    return _flash_attn_4()


def _is_plain(t: Tensor) -> bool:
    # DTensors go through meshlab::attention, whose sharding rule flash-attn does not have.
    if not _build.sharding_available():
        return True
    from torch.distributed.tensor import DTensor

    return not isinstance(t, DTensor)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
              scale: float | None = None) -> Tensor:
    """Attention of q (B, Hq, S, D) over k, v (B, Hkv, Skv, D) -> (B, Hq, S, D) in q.dtype.

    ``Hq`` a multiple of ``Hkv``; ``causal`` masks top-left and needs ``S == Skv``; ``scale``
    defaults to ``1 / sqrt(D)``. No dropout, no mask other than causal. Raises ``ValueError``
    (``TypeError`` for mixed dtypes) before running anything when the shapes do not fit.
    """
    _check(q, k, v, causal)
    scale = _default_scale(q, scale)
    # Under torch.compile the custom op runs (its fake kernel is what the graph needs);
    # flash-attn's Python entry point cannot be traced, and importing it breaks the graph.
    if (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and not torch.compiler.is_compiling()
            and _build.native_disabled_reason() is None
            and all(_is_plain(t) for t in (q, k, v))):
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
    if _build.eager(q, k, v):
        return _Eager.apply(q, k, v, causal, scale)
    return torch.ops.meshlab.attention(q, k, v, causal, scale)[0]


# ---------------------------------------------------------------------------- Hugging Face

# Keyword arguments of transformers' attention interface that ask for math this op lacks.
_HF_UNSUPPORTED = ("softcap", "s_aux", "position_bias")


def _is_plain_causal(mask: Tensor, s: int, skv: int) -> bool:
    """Whether a materialized 4-D mask (bool: True = attend; float: 0 = attend, very negative
    = masked) is exactly the top-left causal mask for every batch row and head.

    Under ``torch.compile`` the values cannot be read without breaking the graph: the check
    becomes a device-side assertion (``torch._assert_async``) that fails the step when the
    mask is not causal, and the shapes and dtype are still checked here."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (s, skv) or s != skv:
        return False
    if mask.dtype == torch.bool:
        ok, seen = None, mask
    elif mask.is_floating_point():
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        ok, seen = ((mask == 0) | blocked).all(), mask == 0
    else:
        return False
    # (arange, not tril: inductor of torch 2.11 fails to lower tril over symbolic sizes)
    rows = torch.arange(s, device=mask.device).unsqueeze(1)
    same = (seen == (torch.arange(skv, device=mask.device) <= rows)).all()
    ok = same if ok is None else ok & same
    if torch.compiler.is_compiling():
        torch._assert_async(ok, "meshlab attention: the attention mask is not the plain "
                                "causal one; use attn_implementation='sdpa'")
        return True
    return bool(ok)


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
    :func:`register_hf`) or exactly the causal mask; padding, sliding-window or custom masks,
    dropout, soft-capping and sinks raise :class:`~meshlab.ConfigError`.
    """
    if dropout:
        raise ConfigError(f"meshlab attention has no dropout, got dropout={dropout} from "
                          f"{type(module).__name__}; set the config's attention_dropout to 0, "
                          f"or use attn_implementation='sdpa'")
    for name in _HF_UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ConfigError(f"meshlab attention does not support {name!r} (asked by "
                              f"{type(module).__name__}); use attn_implementation='sdpa' or "
                              f"'eager' for this model")
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    s, skv = query.shape[2], key.shape[2]
    if attention_mask is not None:
        if not (is_causal and isinstance(attention_mask, Tensor)
                and _is_plain_causal(attention_mask, s, skv)):
            raise ConfigError(
                f"meshlab attention supports causal or no masks only; got a "
                f"{_describe(attention_mask)} mask that is not the plain causal one (padding, "
                f"a sliding window or packed sequences make such masks). Batch without "
                f"padding, or use attn_implementation='sdpa'")
    causal = bool(is_causal and s > 1)        # a SymBool under dynamic shapes -> bool
    if causal and skv > s:
        # Prefill into an empty static cache: the slots past S are empty (the mask function
        # returned None only because of that), so drop them, as the SDPA integration does.
        key, value = key[:, :, :s], value[:, :, :s]
    query, key, value = as_autocast(query, key, value)
    out = attention(query, key, value, causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_hf() -> str:
    """Register :func:`hf_attention` with transformers as ``attn_implementation="meshlab"``.

    Also registers transformers' SDPA mask function under the same name, so a batch
    without padding reaches :func:`hf_attention` with ``attention_mask=None`` and a padded
    one with an explicit mask, which it refuses (a name without a mask function would get
    ``None`` in both cases and silently attend to padding). Idempotent; returns the name.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HF_NAME, hf_attention)
    AttentionMaskInterface.register(HF_NAME, sdpa_mask)
    return HF_NAME


# ---------------------------------------------------------------------------- DTensor

if _build.sharding_available():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.meshlab.attention.default)
    def _(q, k, v, causal, scale):
        # Batch rows and heads are independent; every query needs every key, so never the
        # sequence. lse (B, Hq, S) follows q.
        rules = [([Replicate(), Replicate()], [Replicate()] * 3 + [None, None])]
        for d in (0, 1):
            rules.append(([Shard(d), Shard(d)], [Shard(d)] * 3 + [None, None]))
        return rules

    @register_sharding(torch.ops.meshlab.attention_backward.default)
    def _(dout, q, k, v, out, lse, causal, scale):
        rules = [([Replicate()] * 3, [Replicate()] * 6 + [None, None])]
        for d in (0, 1):
            rules.append(([Shard(d)] * 3, [Shard(d)] * 6 + [None, None]))
        return rules
