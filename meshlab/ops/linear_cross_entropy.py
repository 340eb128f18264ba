"""Cross-entropy of a linear head, chunked over tokens so the full logits never exist.

``loss = cross_entropy(hidden @ weight.T, target)`` for ``hidden`` (N, H), ``weight``
(V, H), ``target`` (N,). Unfused, the (N, V) logits (and their gradient, and a float32
copy) dominate a language model's peak memory: 8192 tokens of a 128k vocabulary are 2 GB
in bfloat16 per copy. Here the forward walks ``chunk`` tokens at a time: logits for the
chunk, their log-sum-exp, the loss, and at once the gradients for ``hidden`` and ``weight``
(softmax minus one-hot, two matrix products), so only (chunk, V) is ever alive. The
backward then only scales the stored gradients by the incoming one.

Registered as ``meshlab::linear_cross_entropy``, which returns sums (loss, number of
counted tokens, and the gradients of the summed loss); :func:`linear_cross_entropy`
divides. Sums make the DTensor rule exact: with ``hidden`` and ``target`` sharded on
tokens and ``weight`` replicated, every sum is a partial sum across the mesh, and the
mean is taken after they are reduced. Matrix products dominate, so there is no hand
kernel: the chunk loop runs PyTorch's (cuBLAS, or the CPU BLAS) on every device.

>>> import torch
>>> from meshlab.ops.linear_cross_entropy import linear_cross_entropy
>>> h, w = torch.randn(6, 8), torch.randn(11, 8)
>>> float(linear_cross_entropy(h, w, torch.tensor([1, 2, 3, -100, 5, 6]))) > 0
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _build


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, target: Tensor,
                                   ignore_index: int = -100) -> Tensor:
    """Unfused: (N, H) @ (V, H).T -> (N, V) logits -> mean cross-entropy, a float32 scalar."""
    logits = _build.upcast(hidden) @ _build.upcast(weight).T
    return F.cross_entropy(logits, target, ignore_index=ignore_index)


@torch.library.custom_op("meshlab::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
                            chunk: int, with_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden (N, H), weight (V, H), target (N,) -> (loss_sum (), count (), dhidden (N, H),
    dweight (V, H)): sums over counted tokens; the gradients are of loss_sum, and empty
    (0-sized) unless ``with_grad``."""
    n = hidden.shape[0]
    _build.record("linear_cross_entropy", hidden.device.type, True,
                  "chunked matmuls (BLAS); matmul-bound, so no separate kernel")
    loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
    count = (target != ignore_index).sum().to(torch.float32)
    gh = torch.empty_like(hidden) if with_grad else hidden.new_empty(0)
    # float32 accumulator: bf16 would round away small per-chunk contributions.
    gw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if with_grad \
        else weight.new_empty(0)
    for s in range(0, n, chunk):
        h, t = hidden[s:s + chunk], target[s:s + chunk]
        logits = (h @ weight.T).float()                               # (c, V)
        lse = torch.logsumexp(logits, dim=-1)                         # (c,)
        valid = t != ignore_index
        tc = torch.where(valid, t, 0)
        picked = logits.gather(1, tc[:, None])[:, 0]
        loss += torch.where(valid, lse - picked, 0.0).sum()
        if with_grad:
            # d(sum loss)/d logits = softmax - one_hot, on counted rows; reuse the logits.
            p = logits.sub_(lse[:, None]).exp_()
            p[torch.arange(p.shape[0], device=p.device), tc] -= 1.0
            p.mul_(valid[:, None])
            p = p.to(hidden.dtype)
            torch.mm(p, weight, out=gh[s:s + chunk])
            gw.add_(p.T @ h)
    return loss, count, gh, gw.to(weight.dtype) if with_grad else gw


@linear_cross_entropy_op.register_fake
def _(hidden, weight, target, ignore_index, chunk, with_grad):
    scalar = hidden.new_empty((), dtype=torch.float32)
    if with_grad:
        return scalar, torch.empty_like(scalar), torch.empty_like(hidden), torch.empty_like(weight)
    return scalar, torch.empty_like(scalar), hidden.new_empty(0), weight.new_empty(0)


def _setup_context(ctx, inputs, output):
    _, count, gh, gw = output
    ctx.mark_non_differentiable(count, gh, gw)
    ctx.save_for_backward(gh, gw)
    ctx.with_grad = inputs[5]


def _backward(ctx, dloss, _dcount, _dgh, _dgw):
    if not ctx.with_grad:
        raise RuntimeError("meshlab::linear_cross_entropy ran with with_grad=False, so it kept "
                           "no gradients; call linear_cross_entropy() with grad enabled")
    gh, gw = ctx.saved_tensors
    return (gh * dloss.to(gh.dtype), gw * dloss.to(gw.dtype), None, None, None, None)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                         ignore_index: int = -100, chunk: int = 4096) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``target``, without the logits.

    hidden: (N, H) or (B, S, H); weight: (V, H); target: (N,) or (B, S), ``ignore_index``
    marking tokens not counted. ``chunk`` tokens are in flight at a time: peak extra memory
    is about ``chunk * V * 6`` bytes (float32 logits and a bf16 copy). Returns a float32
    scalar; gradients are computed in the forward pass when grad mode is on.
    """
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, count, _, _ = torch.ops.meshlab.linear_cross_entropy(hidden, weight, target,
                                                               ignore_index, chunk, with_grad)
    return loss / count


if _build.sharding_available():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.meshlab.linear_cross_entropy.default)
    def _(hidden, weight, target, ignore_index, chunk, with_grad):
        R = Replicate()
        return [
            ([R, R, R, R], [R, R, R, None, None, None]),
            # Tokens split across the mesh: every sum is partial; dhidden stays with its rows.
            ([Partial(), Partial(), Shard(0), Partial()], [Shard(0), R, Shard(0), None, None, None]),
        ]
