"""Rotary position embedding applied to queries or keys, in one pass over the tensor.

``x`` is ``(B, S, NH, D)`` (batch, sequence, heads, head dim) and ``cos``/``sin`` are
``(S, D/2)``, the halves convention of Llama and GPT-NeoX::

    out[..., :D/2] = x1 * cos - x2 * sin
    out[..., D/2:] = x2 * cos + x1 * sin        with x1, x2 = x[..., :D/2], x[..., D/2:]

(Hugging Face stores ``cos`` as ``(S, D)`` with both halves equal: pass ``cos[:, :D//2]``.)
Registered as ``meshlab::rotary``; its backward is the same op rotating by ``-angle``
(``sin`` negated), so the one kernel serves both directions. Gradients for ``cos`` and
``sin``, rarely wanted since they are buffers, are computed with plain PyTorch ops.

DTensor: ``x`` may be sharded on batch (``cos``/``sin`` replicated), on sequence (``cos``
and ``sin`` sharded the same way on their dim 0) or on heads.

>>> import torch
>>> from meshlab.ops import rotary
>>> x = torch.randn(2, 16, 4, 32)
>>> angle = torch.outer(torch.arange(16.0), torch.rand(16))
>>> rotary(x, angle.cos(), angle.sin()).shape
torch.Size([2, 16, 4, 32])
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _build


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Pure-PyTorch rotary. x: (B, S, NH, D), cos, sin: (S, D/2) -> (B, S, NH, D) in x.dtype."""
    half = x.shape[-1] // 2
    xf = _build.upcast(x)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = _build.upcast(cos)[:, None, :], _build.upcast(sin)[:, None, :]   # (S, 1, D/2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"meshlab::rotary: x must be (B, S, NH, D) with D even, got "
                         f"{tuple(x.shape)}")
    want = (x.shape[1], x.shape[-1] // 2)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(f"meshlab::rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} "
                         f"must be (S, D/2) = {want} for x {tuple(x.shape)}; with Hugging "
                         f"Face's (S, D) tables pass cos[:, :D//2]")


def _forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    _check(x, cos, sin)
    k = _build.kernels("rotary", x)
    if k is None:
        return _build.contiguous(rotary_reference(x, cos, sin))
    return k.rotary_fwd(x, cos, sin)        # either kernel takes any layout and table dtype


@torch.library.custom_op("meshlab::rotary", mutates_args=())
def rotary_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, S, NH, D), cos, sin: (S, D/2) -> (B, S, NH, D), contiguous whatever x's strides."""
    return _forward(x, cos, sin)


@rotary_op.register_fake
def _(x, cos, sin):
    # Contiguous, as the kernel's output: not empty_like(x), which would copy the strides of
    # a transposed x (queries as Hugging Face lays them out, or their gradient).
    _check(x, cos, sin)
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, cos, sin = inputs
    # x's gradient is dy rotated back, which needs only the angles; x itself is kept only
    # for the angles' own gradients (they are buffers, so usually not): queries and keys
    # would otherwise stay alive for the backward of every layer.
    ctx.keep_x = bool(cos.requires_grad or sin.requires_grad)
    ctx.save_for_backward(*((x, cos, sin) if ctx.keep_x else (cos, sin)))
    ctx.cos_dtype, ctx.sin_dtype = cos.dtype, sin.dtype


def _backward(ctx, dy):
    x, cos, sin = ctx.saved_tensors if ctx.keep_x else (None, *ctx.saved_tensors)
    # A rotation's transpose is the rotation by the opposite angle.
    # (Through rotary(): the custom op where it must be seen, the kernel directly otherwise.)
    dx = rotary(dy, cos, -sin) if ctx.needs_input_grad[0] else None
    dcos = dsin = None
    if x is not None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
        half = x.shape[-1] // 2
        xf, gf = _build.upcast(x), _build.upcast(dy)
        x1, x2 = xf[..., :half], xf[..., half:]
        g1, g2 = gf[..., :half], gf[..., half:]
        dcos = (g1 * x1 + g2 * x2).sum(dim=(0, 2)).to(ctx.cos_dtype)   # (S, D/2)
        dsin = (g2 * x1 - g1 * x2).sum(dim=(0, 2)).to(ctx.sin_dtype)
    return dx, dcos, dsin


rotary_op.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same kernel without the custom op's dispatch, for plain tensors in eager mode."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        _setup_context(ctx, (x, cos, sin), None)
        return _forward(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        return _backward(ctx, dy)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, S, NH, D) by the angles whose ``cos``/``sin`` are (S, D/2)."""
    if _build.eager(x, cos, sin):
        return _Eager.apply(x, cos, sin)
    return torch.ops.meshlab.rotary(x, cos, sin)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate queries (B, S, NH, D) and keys (B, S, NKV, D) by the same positions."""
    return rotary(q, cos, sin), rotary(k, cos, sin)


if _build.sharding_available():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.meshlab.rotary.default)
    def _(x, cos, sin):
        R = Replicate()
        return [
            ([R], [R, R, R]),
            ([Shard(0)], [Shard(0), R, R]),                 # batch: every shard needs all angles
            ([Shard(1)], [Shard(1), Shard(0), Shard(0)]),   # sequence: angles follow positions
            ([Shard(2)], [Shard(2), R, R]),                 # heads
        ]
