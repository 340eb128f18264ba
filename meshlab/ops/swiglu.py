"""SwiGLU gate, fused forward and backward: ``y = silu(a) * b``.

Registered as ``meshlab::swiglu`` and ``meshlab::swiglu_backward``. Unfused, PyTorch reads
``a`` twice and writes ``silu(a)`` to memory before the product; the fused kernel reads
``a`` and ``b`` once and writes ``y`` once (and in the backward reads three tensors and
writes two). Arithmetic is float32 whatever the input dtype.

DTensor: elementwise, so ``a`` and ``b`` may be sharded on any dim, as long as both are
sharded the same way (the usual case: both come out of column-parallel projections).

>>> import torch
>>> from meshlab.ops import swiglu
>>> swiglu(torch.randn(4, 16), torch.randn(4, 16)).shape
torch.Size([4, 16])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _build


def swiglu_reference(a: Tensor, b: Tensor) -> Tensor:
    """Pure-PyTorch SwiGLU. a, b: (...) of one shape -> (...) in a.dtype."""
    return (F.silu(_build.upcast(a)) * _build.upcast(b)).to(a.dtype)


def _bwd_torch(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    af, g = a.float(), dy.float()
    sig = torch.sigmoid(af)
    da = g * b.float() * sig * (1 + af * (1 - sig))
    db = g * af * sig
    return da.to(a.dtype), db.to(b.dtype)


def _check(a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"meshlab::swiglu: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} "
                         f"{b.dtype} must have one shape and dtype; split the gate and up "
                         f"projections evenly")


def _forward(a: Tensor, b: Tensor) -> Tensor:
    _check(a, b)
    k = _build.kernels("swiglu", a)
    if k is None:
        return _build.contiguous(swiglu_reference(a, b))
    return k.swiglu_fwd(a.contiguous(), b.contiguous()).view(a.shape)


@torch.library.custom_op("meshlab::swiglu", mutates_args=())
def swiglu_op(a: Tensor, b: Tensor) -> Tensor:
    """a, b: (...) -> silu(a) * b, (...)."""
    return _forward(a, b)


@swiglu_op.register_fake
def _(a, b):
    # Contiguous whatever a's strides (a chunk of a packed gate/up projection is not), as
    # the kernels and the fallback return it.
    _check(a, b)
    return a.new_empty(a.shape)


def _backward_impl(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    k = _build.kernels("swiglu_backward", a)
    if k is None:
        da, db = _bwd_torch(dy, a, b)
        return _build.contiguous(da), _build.contiguous(db)
    da, db = k.swiglu_bwd(dy.to(a.dtype).contiguous(), a.contiguous(), b.contiguous())
    return da.view(a.shape), db.view(b.shape)


@torch.library.custom_op("meshlab::swiglu_backward", mutates_args=())
def swiglu_backward(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """dy, a, b: (...) -> (da, db), each (...)."""
    return _backward_impl(dy, a, b)


@swiglu_backward.register_fake
def _(dy, a, b):
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    a, b = ctx.saved_tensors
    return torch.ops.meshlab.swiglu_backward(dy, a, b)


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same kernels without the custom op's dispatch, for plain tensors in eager mode."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _forward(a, b)

    @staticmethod
    def backward(ctx, dy):
        return _backward_impl(dy, *ctx.saved_tensors)


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` for a gate ``a`` and an up projection ``b`` of one shape."""
    if _build.eager(a, b):
        return _Eager.apply(a, b)
    return torch.ops.meshlab.swiglu(a, b)


if _build.sharding_available():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.meshlab.swiglu.default)
    def _(a, b):
        rules = [([Replicate()], [Replicate(), Replicate()])]
        rules += [([Shard(d)], [Shard(d), Shard(d)]) for d in range(a.ndim)]
        return rules

    @register_sharding(torch.ops.meshlab.swiglu_backward.default)
    def _(dy, a, b):
        rules = [([Replicate(), Replicate()], [Replicate()] * 3)]
        rules += [([Shard(d), Shard(d)], [Shard(d)] * 3) for d in range(a.ndim)]
        return rules
