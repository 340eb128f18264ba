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
    return k.swiglu_fwd(a, b).view(a.shape)     # either kernel takes any layout


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


def _backward_y_impl(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    k = _build.kernels("swiglu_backward_y", a)
    if k is None:
        da, db = _bwd_torch(dy, a, b)
        y = swiglu_reference(a, b)
        return _build.contiguous(da), _build.contiguous(db), _build.contiguous(y)
    dy, a, b = dy.to(a.dtype).contiguous(), a.contiguous(), b.contiguous()
    if hasattr(k, "swiglu_bwd_y"):                      # Triton: one pass writes all three
        da, db, y = k.swiglu_bwd_y(dy, a, b)
    else:                                                # C++: the two kernels
        (da, db), y = k.swiglu_bwd(dy, a, b), k.swiglu_fwd(a, b)
    return da.view(a.shape), db.view(b.shape), y.view(a.shape)


@torch.library.custom_op("meshlab::swiglu_backward_y", mutates_args=())
def swiglu_backward_y(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dy, a, b: (...) -> (da, db, y = silu(a) * b), each (...)."""
    return _backward_y_impl(dy, a, b)


@swiglu_backward_y.register_fake
def _(dy, a, b):
    return a.new_empty(a.shape), b.new_empty(b.shape), a.new_empty(a.shape)


class _MLP(torch.autograd.Function):
    """``down(silu(x @ gate.T) * (x @ up.T))`` keeping x, the gate and the up projections
    for the backward but not their product: the backward's swiglu pass rebuilds it (one
    more write of it) for the down weight's gradient. The input gradient of the two input
    projections is summed inside the second matmul (``addmm_``), not by a separate add."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        a, b = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, a, b, w_gate, w_up, w_down)
        return F.linear(swiglu(a, b), w_down)

    @staticmethod
    def backward(ctx, dout):
        x, a, b, w_gate, w_up, w_down = ctx.saved_tensors
        flat = lambda t: t.reshape(-1, t.shape[-1])                       # noqa: E731
        dy = (flat(dout) @ w_down).view(a.shape)
        if _build.eager(dy, a, b):
            da, db, y = _backward_y_impl(dy, a, b)
        else:
            da, db, y = torch.ops.meshlab.swiglu_backward_y(dy, a, b)
        dx = dwg = dwu = dwd = None
        if ctx.needs_input_grad[0]:
            dx = flat(da) @ w_gate
            dx.addmm_(flat(db), w_up)
            dx = dx.view(x.shape)
        if ctx.needs_input_grad[1]:
            dwg = flat(da).t() @ flat(x)
        if ctx.needs_input_grad[2]:
            dwu = flat(db).t() @ flat(x)
        if ctx.needs_input_grad[3]:
            dwd = flat(dout).t() @ flat(y)
        return dx, dwg, dwu, dwd


def swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """A gated MLP without biases, ``(silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``, that
    keeps for the backward what a fused kernel needs and not the gate's output: per token
    ``2 * intermediate`` values saved, where ``down(swiglu(gate(x), up(x)))`` keeps 3 and
    the unfused MLP 4.

    x: (..., hidden); w_gate, w_up: (intermediate, hidden); w_down: (hidden, intermediate),
    all of one dtype. Plain tensors only (a DTensor's layout belongs to its modules' hooks).

    >>> import torch
    >>> x, g, u, d = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    >>> ref = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
    >>> torch.allclose(swiglu_mlp(x, g, u, d), ref, atol=1e-4)
    True
    """
    if not (x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype):
        raise TypeError(f"swiglu_mlp: x {x.dtype}, w_gate {w_gate.dtype}, w_up {w_up.dtype} and "
                        f"w_down {w_down.dtype} must share one dtype; cast the weights")
    if w_gate.shape != w_up.shape or w_down.shape != w_gate.shape[::-1] or \
            x.shape[-1] != w_gate.shape[1]:
        raise ValueError(f"swiglu_mlp: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up "
                         f"{tuple(w_up.shape)}, w_down {tuple(w_down.shape)}: expected (..., h), "
                         f"(i, h), (i, h), (h, i)")
    return _MLP.apply(x, w_gate, w_up, w_down)


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

    @register_sharding(torch.ops.meshlab.swiglu_backward_y.default)
    def _(dy, a, b):
        rules = [([Replicate()] * 3, [Replicate()] * 3)]
        rules += [([Shard(d)] * 3, [Shard(d)] * 3) for d in range(a.ndim)]
        return rules
