"""RMSNorm with a fused forward and backward: ``y = x / sqrt(mean(x**2, -1) + eps) * weight``.

Registered as ``meshlab::rms_norm`` (returns ``y`` and the per-row ``rstd`` the backward
needs) and ``meshlab::rms_norm_backward``. CPU tensors run the C++ kernel in
``csrc/ops_cpu.cpp``, CUDA tensors the Triton kernel in ``_triton.py``; anything else, or a
missing build, runs :func:`rms_norm_reference`'s math. Arithmetic is float32 (float64 for
float64 inputs, which only that math takes), as is ``rstd``; ``y`` comes back in
``x.dtype``.

DTensor: ``x`` may be sharded on any leading dim (batch, sequence) with ``weight``
replicated; the weight gradient is then a partial sum, which DTensor reduces when asked.

``meshlab::add_rms_norm`` (:func:`add_rms_norm`) is the residual add before a pre-norm
block's norm in the same pass, forward and backward; it has no DTensor rule (fuse routes
it for plain tensors only).

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
    xf = _build.upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)                        # (...,)
    return (xf * rstd[..., None] * _build.upcast(weight)).to(x.dtype), rstd


def _bwd_torch(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    up = _build.upcast
    xhat = up(x) * rstd[..., None]                                      # (..., H)
    g = up(dy) * up(weight)
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[..., None]
    dw = (up(dy) * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    k = _build.kernels("rms_norm", x)
    if k is None:
        y, rstd = _fwd_torch(x, weight, eps)
        return _build.contiguous(y), _build.contiguous(rstd)
    h = x.shape[-1]
    y, rstd = k.rms_norm_fwd(x.reshape(-1, h).contiguous(), weight.contiguous(), eps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _backward_impl(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor,
                   ds: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``ds``: a gradient reaching ``x`` besides through the norm (the residual stream's,
    for :func:`add_rms_norm`), added into ``dx`` by the kernel."""
    k = _build.kernels("rms_norm_backward", x)
    if k is None:
        dx, dw = _bwd_torch(dy, x, weight, rstd)
        if ds is not None:
            dx = (_build.upcast(dx) + _build.upcast(ds)).to(x.dtype)
        return _build.contiguous(dx), _build.contiguous(dw)
    h = x.shape[-1]
    dx, dw = k.rms_norm_bwd(dy.to(x.dtype).reshape(-1, h).contiguous(),
                            x.reshape(-1, h).contiguous(), weight.contiguous(),
                            rstd.reshape(-1).float().contiguous(),
                            None if ds is None else ds.to(x.dtype).reshape(-1, h).contiguous())
    return dx.view(x.shape), dw.to(weight.dtype)


@torch.library.custom_op("meshlab::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x: (..., H), weight: (H,) -> (y (..., H) in x.dtype, rstd (...,) float32, float64
    for float64 x)."""
    return _forward(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    # Contiguous outputs whatever x's strides, as the kernels and the fallback return them.
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=_build.stat_dtype(x))


@torch.library.custom_op("meshlab::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor,
                      ds: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """dy, x: (..., H), weight: (H,), rstd: (...,) -> (dx (..., H), dweight (H,)); ``ds``
    (..., H), a gradient reaching ``x`` besides through the norm, added into ``dx`` by the
    kernel."""
    return _backward_impl(dy, x, weight, rstd, ds)


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, ds=None):
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


class _EagerFork(torch.autograd.Function):
    """:func:`rms_norm_fork`'s kernels: the norm's forward, and a backward that adds the
    gradient of the returned view of ``x`` inside the norm's backward kernel."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.set_materialize_grads(False)    # an output not used passes None, not zeros
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_through):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:                      # only the view was used: the norm passes nothing
            return dx_through, None, None
        dx, dw = _backward_impl(dy, x, weight, rstd, dx_through)
        return dx, dw, None


class _TracedFork(torch.autograd.Function):
    """:func:`rms_norm_fork` under ``torch.compile``: the same backward through the custom
    ops, which dynamo traces into the block's graph (the residual stream's gradient added
    by the norm's backward kernel there too, not by a separate add)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.meshlab.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_through):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.meshlab.rms_norm_backward(dy, x, weight, rstd, dx_through)
        return dx, dw, None


def rms_norm_fork(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x, weight, eps), x)`` for a pre-norm block, whose input goes both into
    its norm and around the block on the residual stream: the returned ``x`` (a view) is
    the one to add the block's output to, and the gradient reaching it is added inside the
    norm's backward kernel instead of by autograd's separate accumulation, eagerly and under
    ``torch.compile`` on plain tensors; on DTensors, the same math as ``rms_norm`` and ``x``
    apart.

    >>> import torch
    >>> from meshlab.ops.rms_norm import rms_norm, rms_norm_fork
    >>> x, w = torch.randn(2, 4, 8, requires_grad=True), torch.ones(8)
    >>> y, r = rms_norm_fork(x, w)
    >>> (y * 2 + r * 3).sum().backward()
    >>> x2 = x.detach().requires_grad_()
    >>> (rms_norm(x2, w) * 2 + x2 * 3).sum().backward()
    >>> torch.allclose(x.grad, x2.grad, atol=1e-6)
    True
    """
    if _build.eager(x, weight):
        return _EagerFork.apply(x, weight, eps)
    if torch.compiler.is_compiling() and _build.plain(x, weight):
        return _TracedFork.apply(x, weight, eps)
    return rms_norm(x, weight, eps), x


# ------------------------------------------------------------------ add_rms_norm

def _add_forward(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    k = _build.kernels("add_rms_norm", x)
    if k is None:
        s = x + residual
        y, rstd = _fwd_torch(s, weight, eps)
        return _build.contiguous(y), _build.contiguous(s), _build.contiguous(rstd)
    h = x.shape[-1]
    y, s, rstd = k.add_rms_norm_fwd(x.reshape(-1, h).contiguous(),
                                    residual.reshape(-1, h).contiguous(), weight.contiguous(), eps)
    return y.view(x.shape), s.view(x.shape), rstd.view(x.shape[:-1])


@torch.library.custom_op("meshlab::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual: (..., H) of one dtype, weight: (H,) -> (y = rms_norm(s), s = x + residual,
    rstd (...,) float32)."""
    return _add_forward(x, residual, weight, eps)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape), \
        x.new_empty(x.shape[:-1], dtype=_build.stat_dtype(x))


@torch.library.custom_op("meshlab::add_rms_norm_backward", mutates_args=())
def add_rms_norm_backward(dy: Tensor, ds: Tensor, s: Tensor, weight: Tensor,
                          rstd: Tensor) -> tuple[Tensor, Tensor]:
    """dy, ds, s: (..., H) -> (the gradient of x and of the residual, one tensor; dweight)."""
    return _backward_impl(dy, s, weight, rstd, ds)


@add_rms_norm_backward.register_fake
def _(dy, ds, s, weight, rstd):
    return s.new_empty(s.shape), weight.new_empty(weight.shape)


def _add_setup_context(ctx, inputs, output):
    _, _, weight, _ = inputs
    _, s, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(s, weight, rstd)


def _add_backward(ctx, dy, ds, _drstd):
    s, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.meshlab.add_rms_norm_backward(dy, ds, s, weight, rstd)
    return dx, dx, dw, None


add_rms_norm_op.register_autograd(_add_backward, setup_context=_add_setup_context)


class _EagerAdd(torch.autograd.Function):
    """:func:`add_rms_norm`'s kernels without the custom op's dispatch (eager, plain tensors)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, s, rstd = _add_forward(x, residual, weight, eps)
        ctx.save_for_backward(s, weight, rstd)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = _backward_impl(dy, s, weight, rstd, ds)
        return dx, dx, dw, None


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The residual add before a pre-norm block's RMSNorm, in one pass: ``s = x + residual``
    (rounded to their dtype, as the add alone would be) and ``rms_norm(s, weight, eps)``;
    returns ``(rms_norm(s), s)``. The backward adds the gradient reaching ``s`` directly
    (the residual stream's) inside the norm's backward kernel, so autograd's separate
    accumulation of the two goes too. ``x`` and ``residual``: (..., H) of one dtype and
    shape.

    >>> import torch
    >>> from meshlab.ops.rms_norm import add_rms_norm, rms_norm
    >>> x, r, w = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.ones(8)
    >>> y, s = add_rms_norm(x, r, w)
    >>> torch.equal(s, x + r), torch.allclose(y, rms_norm(x + r, w))
    (True, True)
    """
    if x.dtype != residual.dtype or x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} must match in shape and "
                         f"dtype; cast one, or add them before rms_norm")
    if _build.eager(x, residual, weight):
        return _EagerAdd.apply(x, residual, weight, eps)
    y, s, _ = torch.ops.meshlab.add_rms_norm(x, residual, weight, eps)
    return y, s


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
