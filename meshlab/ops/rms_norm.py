"""RMSNorm with a fused forward and backward: ``y = x / sqrt(mean(x**2, -1) + eps) * weight``.

Registered as ``meshlab::rms_norm`` (returns ``y`` and the per-row ``rstd`` the backward
needs) and ``meshlab::rms_norm_backward``. CPU tensors run the C++ kernel in
``csrc/ops_cpu.cpp``, CUDA tensors the Triton kernel in ``_triton.py``; anything else, or a
missing build, runs :func:`rms_norm_reference`'s math. Arithmetic is float32 whatever the
input dtype; ``y`` comes back in ``x.dtype``.

DTensor: ``x`` may be sharded on any leading dim (batch, sequence) with ``weight``
replicated; the weight gradient is then a partial sum, which DTensor reduces when asked.

>>> import torch
>>> from meshlab.ops import rms_norm
>>> x, w = torch.randn(2, 8, 64), torch.ones(64)
>>> rms_norm(x, w).shape
torch.Size([2, 8, 64])
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _build


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Pure-PyTorch RMSNorm. x: (..., H), weight: (H,) -> (..., H) in x.dtype."""
    xf = _build.upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * _build.upcast(weight)).to(x.dtype)


def _fwd_torch(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)                        # (...,)
    return (xf * rstd[..., None] * weight.float()).to(x.dtype), rstd


def _bwd_torch(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    xhat = x.float() * rstd[..., None]                                  # (..., H)
    g = dy.float() * weight.float()
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[..., None]
    dw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    k = _build.kernels("rms_norm", x)
    if k is None:
        y, rstd = _fwd_torch(x, weight, eps)
        return _build.contiguous(y), _build.contiguous(rstd)
    h = x.shape[-1]
    y, rstd = k.rms_norm_fwd(x.reshape(-1, h).contiguous(), weight.float().contiguous(), eps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _backward_impl(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    k = _build.kernels("rms_norm_backward", x)
    if k is None:
        dx, dw = _bwd_torch(dy, x, weight, rstd)
        return _build.contiguous(dx), _build.contiguous(dw)
    h = x.shape[-1]
    dx, dw = k.rms_norm_bwd(dy.to(x.dtype).reshape(-1, h).contiguous(),
                            x.reshape(-1, h).contiguous(), weight.float().contiguous(),
                            rstd.reshape(-1).float().contiguous())
    return dx.view(x.shape), dw.to(weight.dtype)


@torch.library.custom_op("meshlab::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x: (..., H), weight: (H,) -> (y (..., H) in x.dtype, rstd (...,) float32)."""
    return _forward(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    # Contiguous outputs whatever x's strides, as the kernels and the fallback return them.
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("meshlab::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """dy, x: (..., H), weight: (H,), rstd: (...,) -> (dx (..., H), dweight (H,))."""
    return _backward_impl(dy, x, weight, rstd)


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.meshlab.rms_norm_backward(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same kernels without the custom op's dispatch, for plain tensors in eager mode."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward_impl(dy, x, weight, rstd)
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim. x: (..., H), weight: (H,) -> (..., H) in x.dtype.

    ``eps`` defaults to 1e-6, Llama's value.
    """
    if _build.eager(x, weight):
        return _Eager.apply(x, weight, eps)
    return torch.ops.meshlab.rms_norm(x, weight, eps)[0]


if _build.sharding_available():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.meshlab.rms_norm.default)
    def _(x, weight, eps):
        # The norm reduces over the last dim only, so any leading dim may stay sharded.
        rules = [([Replicate(), Replicate()], [Replicate(), Replicate(), None])]
        for d in range(x.ndim - 1):
            rules.append(([Shard(d), Shard(d)], [Shard(d), Replicate(), None]))
        return rules

    @register_sharding(torch.ops.meshlab.rms_norm_backward.default)
    def _(dy, x, weight, rstd):
        rules = [([Replicate(), Replicate()], [Replicate()] * 4)]
        for d in range(x.ndim - 1):
            # Each shard sums dweight over its own rows: a partial sum across the mesh.
            rules.append(([Shard(d), Partial()], [Shard(d), Shard(d), Replicate(), Shard(d)]))
        return rules
