"""Gated activations, fused forward and backward: SwiGLU ``y = silu(a) * b`` and GeGLU
``y = gelu_tanh(a) * b`` (GELU with the tanh approximation, Gemma's MLP).

Registered as ``meshlab::swiglu`` / ``meshlab::geglu`` with their ``*_backward`` and
``*_backward_y`` ops, both on the same kernels (an activation switch). Unfused, PyTorch
reads ``a`` twice and writes ``act(a)`` to memory before the product; the fused kernel
reads ``a`` and ``b`` once and writes ``y`` once (and in the backward reads three tensors
and writes two). Arithmetic is float32 whatever the input dtype.

DTensor: elementwise, so ``a`` and ``b`` may be sharded on any dim, as long as both are
sharded the same way (the usual case: both come out of column-parallel projections).

>>> import torch
>>> from meshlab.ops import geglu, swiglu
>>> swiglu(torch.randn(4, 16), torch.randn(4, 16)).shape
torch.Size([4, 16])
>>> a, b = torch.randn(4, 16), torch.randn(4, 16)
>>> torch.allclose(geglu(a, b), torch.nn.functional.gelu(a, approximate="tanh") * b, atol=1e-6)
True
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _build
from .matmul import mm_sum

# Activation codes the kernels take: 0 SiLU, 1 tanh-approximated GELU.
_ACT = {"swiglu": 0, "geglu": 1}


def swiglu_reference(a: Tensor, b: Tensor) -> Tensor:
    """Pure-PyTorch SwiGLU. a, b: (...) of one shape -> (...) in a.dtype."""
    return (F.silu(_build.upcast(a)) * _build.upcast(b)).to(a.dtype)


def geglu_reference(a: Tensor, b: Tensor) -> Tensor:
    """Pure-PyTorch GeGLU (tanh GELU). a, b: (...) of one shape -> (...) in a.dtype."""
    return (F.gelu(_build.upcast(a), approximate="tanh") * _build.upcast(b)).to(a.dtype)


_REFERENCE = {"swiglu": swiglu_reference, "geglu": geglu_reference}


def _bwd_torch(dy: Tensor, a: Tensor, b: Tensor, name: str) -> tuple[Tensor, Tensor]:
    up = _build.upcast                   # float32, float64 for float64 inputs
    af, g = up(a), up(dy)
    if name == "swiglu":
        sig = torch.sigmoid(af)
        act, grad = af * sig, sig * (1 + af * (1 - sig))
    else:
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (af + 0.044715 * af ** 3))
        act = 0.5 * af * (1 + t)
        grad = 0.5 * (1 + t) + 0.5 * af * (1 - t * t) * k * (1 + 3 * 0.044715 * af * af)
    return (g * up(b) * grad).to(a.dtype), (g * act).to(b.dtype)


def _check(a: Tensor, b: Tensor, name: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"meshlab::{name}: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} "
                         f"{b.dtype} must have one shape and dtype; split the gate and up "
                         f"projections evenly")


def _forward(a: Tensor, b: Tensor, name: str) -> Tensor:
    _check(a, b, name)
    k = _build.kernels(name, a)
    if k is None:
        return _build.contiguous(_REFERENCE[name](a, b))
    return k.swiglu_fwd(a, b, _ACT[name]).view(a.shape)     # either kernel: any layout


def _backward_impl(dy: Tensor, a: Tensor, b: Tensor, name: str) -> tuple[Tensor, Tensor]:
    k = _build.kernels(f"{name}_backward", a)
    if k is None:
        da, db = _bwd_torch(dy, a, b, name)
        return _build.contiguous(da), _build.contiguous(db)
    da, db = k.swiglu_bwd(dy.to(a.dtype).contiguous(), a.contiguous(), b.contiguous(),
                          _ACT[name])
    return da.view(a.shape), db.view(b.shape)


def _backward_y_impl(dy: Tensor, a: Tensor, b: Tensor,
                     name: str) -> tuple[Tensor, Tensor, Tensor]:
    k = _build.kernels(f"{name}_backward_y", a)
    if k is None:
        da, db = _bwd_torch(dy, a, b, name)
        y = _REFERENCE[name](a, b)
        return _build.contiguous(da), _build.contiguous(db), _build.contiguous(y)
    dy, a, b = dy.to(a.dtype).contiguous(), a.contiguous(), b.contiguous()
    if hasattr(k, "swiglu_bwd_y"):                      # Triton: one pass writes all three
        da, db, y = k.swiglu_bwd_y(dy, a, b, _ACT[name])
    else:                                                # C++: the two kernels
        (da, db), y = k.swiglu_bwd(dy, a, b, _ACT[name]), k.swiglu_fwd(a, b, _ACT[name])
    return da.view(a.shape), db.view(b.shape), y.view(a.shape)


def _register(name: str) -> None:
    """Register ``meshlab::<name>``, ``meshlab::<name>_backward`` and
    ``meshlab::<name>_backward_y`` (the gradients and ``y`` rebuilt, for the fused MLP) with
    their fakes and autograd."""

    def fwd(a: Tensor, b: Tensor) -> Tensor:
        return _forward(a, b, name)

    def fwd_fake(a, b):
        # Contiguous whatever a's strides (a chunk of a packed gate/up projection is not),
        # as the kernels and the fallback return it.
        _check(a, b, name)
        return a.new_empty(a.shape)

    def bwd(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return _backward_impl(dy, a, b, name)

    def bwd_y(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _backward_y_impl(dy, a, b, name)

    op = torch.library.custom_op(f"meshlab::{name}", fwd, mutates_args=())
    op.register_fake(fwd_fake)
    bwd_op = torch.library.custom_op(f"meshlab::{name}_backward", bwd, mutates_args=())
    bwd_op.register_fake(lambda dy, a, b: (a.new_empty(a.shape), b.new_empty(b.shape)))
    bwd_y_op = torch.library.custom_op(f"meshlab::{name}_backward_y", bwd_y, mutates_args=())
    bwd_y_op.register_fake(lambda dy, a, b: (a.new_empty(a.shape), b.new_empty(b.shape),
                                             a.new_empty(a.shape)))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        return getattr(torch.ops.meshlab, f"{name}_backward")(dy, a, b)

    op.register_autograd(backward, setup_context=setup_context)


for _name in _ACT:
    _register(_name)


class _Eager(torch.autograd.Function):
    """The same kernels without the custom op's dispatch, for plain tensors in eager mode."""

    @staticmethod
    def forward(ctx, a, b, name):
        ctx.save_for_backward(a, b)
        ctx.name = name
        return _forward(a, b, name)

    @staticmethod
    def backward(ctx, dy):
        return (*_backward_impl(dy, *ctx.saved_tensors, ctx.name), None)


def _backward_side_by_side(dy: Tensor, a: Tensor, b: Tensor, name: str):
    """``(dab, y)``: the gated pass's gradients of ``a`` and ``b`` written as the halves of
    each row of one ``(tokens, 2 * intermediate)`` buffer, and ``y`` rebuilt; None where
    the Triton kernels do not run."""
    k = _build.kernels(f"{name}_backward_y", a)
    if k is None or not hasattr(k, "swiglu_bwd_y_side_by_side"):
        return None
    dy, a, b = dy.to(a.dtype).contiguous(), a.contiguous(), b.contiguous()
    return k.swiglu_bwd_y_side_by_side(dy, a, b, _ACT[name])


class _MLP(torch.autograd.Function):
    """``down(act(x @ gate.T) * (x @ up.T))`` keeping x, the gate and the up projections
    for the backward but not their product: the backward's gated pass rebuilds it (one
    more write of it) for the down weight's gradient. The input gradient of the two input
    projections is summed inside the second matmul (``addmm_``), not by a separate add.
    Eagerly on the GPU the gated pass writes the gate's and the up projection's gradients
    side by side, and both weights' gradients are one product, ``[da | db].T @ x``, whose
    two halves they are: at TinyLlama's shape (16,384 tokens, hidden 2048, intermediate
    5632) 1.08 ms against 1.22 for the two products, one H100
    (``benchmarks/results/mlp_nvidia_h100_80gb_hbm3.json``, ``dw_one``/``dw_two``)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, name, residual=None):
        a, b = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, a, b, w_gate, w_up, w_down)
        ctx.name = name
        y = _gated(a, b, name)
        if residual is None:
            return F.linear(y, w_down)
        # the residual stream added inside the down product (cuBLAS's beta = 1 epilogue),
        # not by a pass of its own over a (tokens, hidden) tensor
        flat = residual.reshape(-1, residual.shape[-1])
        return torch.addmm(flat, y.reshape(-1, y.shape[-1]), w_down.t()).view(residual.shape)

    @staticmethod
    def backward(ctx, dout):
        x, a, b, w_gate, w_up, w_down = ctx.saved_tensors
        flat = lambda t: t.reshape(-1, t.shape[-1])                       # noqa: E731
        dy = (flat(dout) @ w_down).view(a.shape)
        both = None
        if _build.eager(dy, a, b):
            both = _backward_side_by_side(dy, a, b, ctx.name) \
                if ctx.needs_input_grad[1] and ctx.needs_input_grad[2] else None
            if both is not None:
                (dab, y), i = both, a.shape[-1]
                da, db = dab[:, :i], dab[:, i:]          # rows of 2 * i: no copies
            else:
                da, db, y = _backward_y_impl(dy, a, b, ctx.name)
        else:
            da, db, y = getattr(torch.ops.meshlab, f"{ctx.name}_backward_y")(dy, a, b)
        dx = dwg = dwu = dwd = None
        if ctx.needs_input_grad[0]:
            dx = mm_sum([flat(da), flat(db)], [w_gate, w_up]).view(x.shape)
        if both is not None:                           # both weights' gradients at once
            dwg, dwu = (dab.t() @ flat(x)).split(a.shape[-1])
        if ctx.needs_input_grad[1] and dwg is None:
            dwg = flat(da).t() @ flat(x)
        if ctx.needs_input_grad[2] and dwu is None:
            dwu = flat(db).t() @ flat(x)
        if ctx.needs_input_grad[3]:
            dwd = flat(dout).t() @ flat(y)
        return dx, dwg, dwu, dwd, None, dout if ctx.needs_input_grad[5] else None


def _gated(a: Tensor, b: Tensor, name: str) -> Tensor:
    if _build.eager(a, b):
        return _Eager.apply(a, b, name)
    return getattr(torch.ops.meshlab, name)(a, b)


def _mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, name: str,
         residual: Tensor | None = None) -> Tensor:
    if not (x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype):
        raise TypeError(f"{name}_mlp: x {x.dtype}, w_gate {w_gate.dtype}, w_up {w_up.dtype} and "
                        f"w_down {w_down.dtype} must share one dtype; cast the weights")
    if w_gate.shape != w_up.shape or w_down.shape != w_gate.shape[::-1] or \
            x.shape[-1] != w_gate.shape[1]:
        raise ValueError(f"{name}_mlp: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up "
                         f"{tuple(w_up.shape)}, w_down {tuple(w_down.shape)}: expected (..., h), "
                         f"(i, h), (i, h), (h, i)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{name}_mlp: residual {tuple(residual.shape)} {residual.dtype} must "
                         f"have x's shape and dtype, {tuple(x.shape)} {x.dtype}")
    quack = _quack_route(x, w_gate, w_up, w_down, name)
    if quack is not None:
        # The products with the activation in their epilogues; the gate and up weights as
        # one (2 * intermediate, hidden) operand, whose gradient autograd splits back.
        out = quack(x, torch.cat([w_gate, w_up]), w_down, activation=name,
                    tuned=QUACK_TUNED, concat_layout=True)
        return out if residual is None else residual + out
    return _MLP.apply(x, w_gate, w_up, w_down, name, residual)


# Whether a Hopper card with quack-kernels installed runs the MLP on its gated GEMMs (see
# :func:`_quack_route`). Off until a whole training step on it is measured faster than on
# meshlab's own MLP: the benchmarks' ``meshlab_fuse_quack_mlp`` row turns it on.
QUACK_MLP = False
# Whether that route autotunes quack's tile configurations (each GEMM shape compiled and
# timed over its candidates at its first call) or takes its default configuration.
QUACK_TUNED = True


@functools.cache
def _quack_mlp():
    """``(quack.mlp.mlp_func, version)`` where quack-kernels is installed and this is a
    Hopper card, else None. An installed one that fails to import raises."""
    return _build.hopper_package("quack.mlp", "quack-kernels", "mlp_func",
                                 "the MLP then runs on cuBLAS and meshlab's kernels")


def _quack_route(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, name: str):
    """quack-kernels' ``mlp_func`` for this call, or None: SwiGLU only (its GeGLU is not
    Gemma's tanh GELU), eager plain CUDA tensors in bf16 or fp16 that need a gradient, the
    feature sizes multiples of 8 (its TMA alignment) and x's rows contiguous."""
    if not QUACK_MLP or name != "swiglu" or not x.is_cuda or \
            x.dtype not in (torch.bfloat16, torch.float16) or not torch.is_grad_enabled() or \
            not any(t.requires_grad for t in (x, w_gate, w_up, w_down)) or \
            not _build.eager(x, w_gate, w_up, w_down) or x.stride(-1) != 1 or \
            w_gate.shape[0] % 8 or w_gate.shape[1] % 8:
        return None
    found = _quack_mlp()
    if found is None:
        return None
    _build.record("swiglu_mlp", "cuda", True, f"quack-kernels {found[1]} gated GEMMs")
    return found[0]


def swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               residual: Tensor | None = None) -> Tensor:
    """A gated MLP without biases, ``(silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``, that
    keeps for the backward what a fused kernel needs and not the gate's output: per token
    ``2 * intermediate`` values saved, where ``down(swiglu(gate(x), up(x)))`` keeps 3 and
    the unfused MLP 4. With ``residual`` (x's shape and dtype), ``residual + mlp(x)``,
    the sum taken inside the down product (a decoder layer's residual stream).

    x: (..., hidden); w_gate, w_up: (intermediate, hidden); w_down: (hidden, intermediate),
    all of one dtype. Plain tensors only (a DTensor's layout belongs to its modules' hooks).

    >>> import torch
    >>> x, g, u, d = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    >>> ref = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
    >>> torch.allclose(swiglu_mlp(x, g, u, d), ref, atol=1e-4)
    True
    """
    return _mlp(x, w_gate, w_up, w_down, "swiglu", residual)


def geglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
              residual: Tensor | None = None) -> Tensor:
    """:func:`swiglu_mlp` with the tanh GELU as the gate's activation (Gemma's MLP)."""
    return _mlp(x, w_gate, w_up, w_down, "geglu", residual)


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` for a gate ``a`` and an up projection ``b`` of one shape."""
    return _gated(a, b, "swiglu")


def geglu(a: Tensor, b: Tensor) -> Tensor:
    """``gelu(a, approximate='tanh') * b`` for a gate ``a`` and an up projection ``b``."""
    return _gated(a, b, "geglu")


if _build.sharding_available():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    for _name in _ACT:
        @register_sharding(getattr(torch.ops.meshlab, _name).default)
        def _(a, b):
            rules = [([Replicate()], [Replicate(), Replicate()])]
            rules += [([Shard(d)], [Shard(d), Shard(d)]) for d in range(a.ndim)]
            return rules

        @register_sharding(getattr(torch.ops.meshlab, f"{_name}_backward").default)
        def _(dy, a, b):
            rules = [([Replicate(), Replicate()], [Replicate()] * 3)]
            rules += [([Shard(d), Shard(d)], [Shard(d)] * 3) for d in range(a.ndim)]
            return rules

        @register_sharding(getattr(torch.ops.meshlab, f"{_name}_backward_y").default)
        def _(dy, a, b):
            rules = [([Replicate()] * 3, [Replicate()] * 3)]
            rules += [([Shard(d)] * 3, [Shard(d)] * 3) for d in range(a.ndim)]
            return rules
