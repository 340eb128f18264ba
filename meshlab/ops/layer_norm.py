"""LayerNorm over the last dim, fused forward and backward, with float32 statistics
(float64 for float64 inputs).

``y = (x - mean) / sqrt(var + eps) * weight + bias``, registered as ``meshlab::layer_norm``
(returns ``y`` and the per-row ``mean`` and ``rstd`` the backward needs) and
``meshlab::layer_norm_backward``. The variance is computed in two passes over the row
(mean first), which stays accurate when the mean is large next to the spread.

DTensor: ``x`` may be sharded on any leading dim with ``weight`` and ``bias`` replicated;
their gradients are then partial sums.

>>> import torch
>>> from meshlab.ops import layer_norm
>>> layer_norm(torch.randn(3, 32), torch.ones(32), torch.zeros(32)).shape
torch.Size([3, 32])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _build


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Pure-PyTorch LayerNorm. x: (..., H), weight, bias: (H,) -> (..., H) in x.dtype."""
    h = x.shape[-1]
    up = _build.upcast
    return F.layer_norm(up(x), (h,), up(weight), up(bias), eps).to(x.dtype)


def _fwd_torch(x: Tensor, weight: Tensor, bias: Tensor, eps: float):
    up = _build.upcast
    xf = up(x)
    mean = xf.mean(-1)                                                   # (...,)
    rstd = torch.rsqrt((xf - mean[..., None]).pow(2).mean(-1) + eps)
    y = (xf - mean[..., None]) * rstd[..., None] * up(weight) + up(bias)
    return y.to(x.dtype), mean, rstd


def _bwd_torch(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor):
    h = x.shape[-1]
    up = _build.upcast
    xhat = (up(x) - mean[..., None]) * rstd[..., None]
    g = up(dy) * up(weight)
    dx = (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[..., None]
    dw = (up(dy) * xhat).reshape(-1, h).sum(0)
    db = up(dy).reshape(-1, h).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(weight.dtype)


def _forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float):
    k = _build.kernels("layer_norm", x)
    if k is None:
        return tuple(_build.contiguous(t) for t in _fwd_torch(x, weight, bias, eps))
    h = x.shape[-1]
    y, mean, rstd = k.layer_norm_fwd(x.reshape(-1, h).contiguous(), weight.contiguous(),
                                     bias.contiguous(), eps)
    lead = x.shape[:-1]
    return y.view(x.shape), mean.view(lead), rstd.view(lead)


@torch.library.custom_op("meshlab::layer_norm", mutates_args=())
def layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor,
                  eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x: (..., H), weight, bias: (H,) -> (y (..., H), mean (...,), rstd (...,)), stats float32
    (float64 for float64 x)."""
    return _forward(x, weight, bias, eps)


@layer_norm_op.register_fake
def _(x, weight, bias, eps):
    # Contiguous outputs whatever x's strides, as the kernels and the fallback return them.
    stat = x.new_empty(x.shape[:-1], dtype=_build.stat_dtype(x))
    return x.new_empty(x.shape), stat, torch.empty_like(stat)


def _backward_impl(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor):
    k = _build.kernels("layer_norm_backward", x)
    if k is None:
        return tuple(_build.contiguous(t) for t in _bwd_torch(dy, x, weight, mean, rstd))
    h = x.shape[-1]
    dx, dw, db = k.layer_norm_bwd(dy.to(x.dtype).reshape(-1, h).contiguous(),
                                  x.reshape(-1, h).contiguous(), weight.contiguous(),
                                  mean.reshape(-1).float().contiguous(),
                                  rstd.reshape(-1).float().contiguous())
    return dx.view(x.shape), dw.to(weight.dtype), db.to(weight.dtype)


@torch.library.custom_op("meshlab::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                        rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dy, x: (..., H), weight: (H,), mean, rstd: (...,) -> (dx, dweight (H,), dbias (H,))."""
    return _backward_impl(dy, x, weight, mean, rstd)


@layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.meshlab.layer_norm_backward(dy, x, weight, mean, rstd)
    return dx, dw, db.to(ctx.bias_dtype), None


layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same kernels without the custom op's dispatch, for plain tensors in eager mode."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw, db = _backward_impl(dy, *ctx.saved_tensors)
        return dx, dw, db.to(ctx.bias_dtype), None


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim. x: (..., H), weight, bias: (H,) -> (..., H) in x.dtype.

    ``eps`` defaults to 1e-5, ``torch.nn.LayerNorm``'s value.
    """
    if _build.eager(x, weight, bias):
        return _Eager.apply(x, weight, bias, eps)
    return torch.ops.meshlab.layer_norm(x, weight, bias, eps)[0]


if _build.sharding_available():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.meshlab.layer_norm.default)
    def _(x, weight, bias, eps):
        R = Replicate()
        rules = [([R, R, R], [R, R, R, None])]
        for d in range(x.ndim - 1):
            rules.append(([Shard(d)] * 3, [Shard(d), R, R, None]))
        return rules

    @register_sharding(torch.ops.meshlab.layer_norm_backward.default)
    def _(dy, x, weight, mean, rstd):
        R = Replicate()
        rules = [([R, R, R], [R] * 5)]
        for d in range(x.ndim - 1):
            rules.append(([Shard(d), Partial(), Partial()],
                          [Shard(d), Shard(d), R, Shard(d), Shard(d)]))
        return rules
