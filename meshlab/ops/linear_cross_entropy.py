"""Cross-entropy of a linear head, chunked over tokens so the full logits never exist.

``loss = cross_entropy(hidden @ weight.T, target)`` for ``hidden`` (N, H), ``weight``
(V, H), ``target`` (N,). Unfused, the (N, V) logits (and their gradient, and a float32
copy) dominate a language model's peak memory: 8192 tokens of a 128k vocabulary are 2 GB
in bfloat16 per copy. Here the forward walks ``chunk`` tokens at a time: the chunk's
logits (one matrix product), then one kernel that reads them twice and overwrites them in
place with ``softmax - onehot`` while returning each row's loss (C++ on the CPU, Triton on
CUDA), then the gradients for ``hidden`` and ``weight`` (two more products). Only one
(chunk, V) buffer is ever alive, and the three products are the ones an unfused forward
and backward run anyway. The backward then only scales the stored gradients.

Registered as ``meshlab::linear_cross_entropy``, which returns sums (loss, number of
counted tokens, and the gradients of the summed loss); :func:`linear_cross_entropy`
divides. Sums make the DTensor rule exact: with ``hidden`` and ``target`` sharded on
tokens and ``weight`` replicated, every sum is a partial sum across the mesh, and the
mean is taken after they are reduced. The products are PyTorch's (cuBLAS, or the CPU
BLAS); only the softmax step is meshlab's kernel.

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


def _ce_grad_torch(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """The kernels' contract in PyTorch: per-row loss, and ``logits`` overwritten in place by
    ``softmax - onehot(target)`` (zero on ignored rows)."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    valid = target != ignore_index
    tc = torch.where(valid, target, 0)
    loss = torch.where(valid, lse - z.gather(1, tc[:, None])[:, 0], 0.0)
    p = z.sub_(lse[:, None]).exp_()              # z is logits itself when they are float32
    p[torch.arange(p.shape[0], device=p.device), tc] -= 1.0
    logits.copy_(p.mul_(valid[:, None]))
    return loss


@torch.library.custom_op("meshlab::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
                            chunk: int, with_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden (N, H), weight (V, H), target (N,) -> (loss_sum (), count (), dhidden (N, H),
    dweight (V, H)): sums over counted tokens; the gradients are of loss_sum, and empty
    (0-sized) unless ``with_grad``."""
    n = hidden.shape[0]
    loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
    count = (target != ignore_index).sum().to(torch.float32)
    # Contiguous gradients whatever the inputs' strides, as the fake says (empty_like would
    # copy the strides of a transposed hidden or weight).
    gh = hidden.new_empty(hidden.shape) if with_grad else hidden.new_empty(0)
    # Accumulated in the weight's dtype, one addmm per chunk (cuBLAS sums each product in
    # float32): a float32 accumulator for a bfloat16 head would cost 2 bytes more per weight
    # element than the whole gradient.
    gw = weight.new_zeros(weight.shape) if with_grad else weight.new_empty(0)
    target = target.contiguous()
    for s in range(0, n, chunk):
        h, t = hidden[s:s + chunk], target[s:s + chunk]
        z = h @ weight.T                                              # (c, V), hidden.dtype
        k = _build.kernels("linear_cross_entropy", z)
        # z becomes d(sum loss)/dz = softmax - onehot, in place: one (c, V) buffer in all.
        rows = k.ce_grad_inplace(z, t, ignore_index) if k is not None else \
            _ce_grad_torch(z, t, ignore_index)
        loss += rows.sum()
        if with_grad:
            torch.mm(z, weight, out=gh[s:s + chunk])
            gw.addmm_(z.T, h)
        del z, rows          # before the next chunk's product, or two (chunk, V) buffers live
    return loss, count, gh, gw


@linear_cross_entropy_op.register_fake
def _(hidden, weight, target, ignore_index, chunk, with_grad):
    scalar = hidden.new_empty((), dtype=torch.float32)
    if with_grad:
        return (scalar, torch.empty_like(scalar), hidden.new_empty(hidden.shape),
                weight.new_empty(weight.shape))
    return scalar, torch.empty_like(scalar), hidden.new_empty(0), weight.new_empty(0)


def _setup_context(ctx, inputs, output):
    _, count, gh, gw = output
    ctx.mark_non_differentiable(count, gh, gw)
    ctx.save_for_backward(gh, gw)
    ctx.with_grad = inputs[5]
    ctx.consumed = False


def _backward(ctx, dloss, _dcount, _dgh, _dgw):
    if not ctx.with_grad:
        raise RuntimeError("meshlab::linear_cross_entropy ran with with_grad=False, so it kept "
                           "no gradients; call linear_cross_entropy() with grad enabled")
    if ctx.consumed:
        raise RuntimeError("meshlab::linear_cross_entropy's backward ran twice on one forward: "
                           "it scales its stored gradients in place, so retain_graph=True "
                           "cannot reuse them; run the forward again")
    gh, gw = ctx.saved_tensors
    if type(gh) is not torch.Tensor or type(gw) is not torch.Tensor:
        # Traced (AOTAutograd's functional tensors) or DTensor: a graph must not mutate
        # what it saved, so scale out of place there.
        return gh * dloss.to(gh.dtype), gw * dloss.to(gw.dtype), None, None, None, None
    ctx.consumed = True
    # In place: a second (V, H) buffer here would be the op's peak (measured on the H200:
    # 3.12 GiB out of place, 2.08 GiB in place, at 8192 tokens of a 128k vocabulary).
    return gh.mul_(dloss.to(gh.dtype)), gw.mul_(dloss.to(gw.dtype)), None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# Default chunk: about 2**29 logits in flight (1 GiB in bfloat16), a power of two of tokens.
_LOGITS_BUDGET = 2 ** 29


def default_chunk(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``: 4096 for Llama-3's 128,256."""
    return max(64, 1 << max(0, (_LOGITS_BUDGET // max(vocab, 1)).bit_length() - 1))


def _checked(name: str, rows: str, hidden: Tensor, weight: Tensor, target: Tensor, chunk,
             vocab: int | None):
    """The arguments of ``name`` checked: ``(hidden (N, H), target (N,), chunk)``, the
    chunk by default ``default_chunk`` of ``vocab`` (the weight's rows where None)."""
    if hidden.shape[-1] != weight.shape[-1] or weight.ndim != 2:
        raise ValueError(f"{name}: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)} do not match; weight must be ({rows}, "
                         f"{hidden.shape[-1]})")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"{name}: hidden is {hidden.dtype} but weight is {weight.dtype}; cast "
                        f"one so they match")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"{name}: target {tuple(target.shape)} must be hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")
    chunk = default_chunk(weight.shape[0] if vocab is None else vocab) if chunk is None \
        else int(chunk)
    if chunk < 1:
        raise ValueError(f"{name}: chunk must be >= 1, got {chunk}")
    return hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1), chunk


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                         ignore_index: int = -100, chunk: int | None = None) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``target``, without the logits.

    hidden: (N, H) or (B, S, H); weight: (V, H) of the same dtype; target: (N,) or (B, S)
    integers, ``ignore_index`` marking tokens not counted. ``chunk`` tokens are in flight
    at a time (default :func:`default_chunk`): the extra memory is one (chunk, V) buffer
    in ``hidden.dtype`` plus the weight gradient. Returns a float32 scalar (NaN when no
    token counts, as ``F.cross_entropy``); gradients are computed in the forward pass when
    grad mode is on, and the weight gradient is accumulated in the weight's dtype.
    """
    hidden, target, chunk = _checked("linear_cross_entropy", "vocab", hidden, weight, target,
                                     chunk, None)
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


# ----------------------------------------------------------- split over the vocabulary

class _SplitLinearCrossEntropy(torch.autograd.Function):
    """The chunked loss with the head's rows split over ``group``: each rank holds
    ``weight`` = rows ``[start, start + V_local)`` of a vocabulary of ``vocab``, and the
    whole ``hidden`` and ``target``. Per chunk, each rank's logits give its row-wise
    log-sum-exp and its share of the target logit; one all-gather of those two numbers a
    token makes the whole-vocabulary log-sum-exp on every rank, and each rank's logits
    become ``softmax - onehot`` on its own rows. The gradients follow as in the whole op:
    ``weight``'s is this rank's rows, exact; ``hidden``'s is this rank's share of the sum
    over the vocabulary, which the head's region sums over ``group`` in the backward (the
    column-parallel input's all-reduce, as for the unfused head)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, start, group, ignore_index, chunk, with_grad):
        import torch.distributed as dist

        from ..core.collectives import all_gather_into

        n = dist.get_world_size(group)
        wide = hidden.dtype if hidden.dtype in (torch.float32, torch.float64) else torch.float32
        rows_here = weight.shape[0]
        loss = torch.zeros((), device=hidden.device, dtype=wide)
        gh = hidden.new_empty(hidden.shape) if with_grad else None
        gw = weight.new_zeros(weight.shape) if with_grad else None
        with torch.no_grad():
            for s in range(0, hidden.shape[0], chunk):
                h, t = hidden[s:s + chunk], target[s:s + chunk]
                valid = t != ignore_index
                mine = valid & (t >= start) & (t < start + rows_here)
                col = torch.where(mine, t - start, 0)
                z = (h @ weight.T).to(wide)                               # (c, V_local)
                stats = torch.stack([
                    torch.logsumexp(z, dim=-1) if rows_here else
                    z.new_full((h.shape[0],), -torch.inf),
                    torch.where(mine, z.gather(1, col[:, None])[:, 0], 0.0)
                    if rows_here else z.new_zeros(h.shape[0])])          # (2, c)
                every = stats.new_empty((n * 2, stats.shape[1]))
                all_gather_into(every, stats, group)
                every = every.view(n, 2, -1)
                lse = torch.logsumexp(every[:, 0], dim=0)
                loss += torch.where(valid, lse - every[:, 1].sum(0), 0.0).sum()
                if not with_grad:
                    continue
                g = z.sub_(lse[:, None]).exp_()
                g[torch.arange(g.shape[0], device=g.device)[mine], col[mine]] -= 1.0
                g = g.mul_(valid[:, None]).to(hidden.dtype)
                torch.mm(g, weight, out=gh[s:s + chunk])
                gw.addmm_(g.T, h)
                del z, g
        count = (target != ignore_index).sum().to(wide)
        ctx.save_for_backward(gh, gw)
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, dloss, _dcount):
        gh, gw = ctx.saved_tensors
        if gh is None:
            raise RuntimeError("linear_cross_entropy_split ran without grad, so it kept no "
                               "gradients; call it with grad enabled")
        return (gh * dloss.to(gh.dtype), gw * dloss.to(gw.dtype)) + (None,) * 6


def linear_cross_entropy_split(hidden: Tensor, weight: Tensor, target: Tensor, *, start: int,
                               vocab: int, group, ignore_index: int = -100,
                               chunk: int | None = None) -> Tensor:
    """:func:`linear_cross_entropy` of a head whose rows are split over the ranks of
    ``group`` (tensor parallelism over the vocabulary): this rank holds ``weight`` = rows
    ``[start, start + weight.shape[0])`` of ``vocab``, and every rank the same ``hidden``
    and ``target``. The whole logits exist on no rank, nor does any rank's shard of them:
    one (chunk, V / ranks) buffer is alive at a time, and the ranks exchange two numbers
    a token per chunk. Every rank returns the same mean loss (float32, float64 for float64
    inputs). The gradient of ``hidden`` is this rank's share, to be summed over ``group``
    in the backward (as a column-parallel region's input is); ``weight``'s is exact for its
    rows. Targets outside ``[0, vocab)`` (other than ``ignore_index``) would read as a zero
    logit: on the CPU they raise ``IndexError`` here, before any exchange; on a GPU (where
    reading them back would stall each step) the caller checks them, as meshlab's fused
    head does through the model's vocabulary guard.
    """
    hidden, target, chunk = _checked("linear_cross_entropy_split", "rows", hidden, weight,
                                     target, chunk, vocab)
    if not 0 <= start <= vocab - weight.shape[0]:
        raise ValueError(f"linear_cross_entropy_split: rows [{start}, "
                         f"{start + weight.shape[0]}) are not within the vocabulary of {vocab}")
    # on the CPU, as the whole op's kernel checks its targets (a GPU's would stall to read)
    counted = target[target != ignore_index] if target.device.type == "cpu" else target[:0]
    low, high = (int(counted.min()), int(counted.max())) if counted.numel() else (0, 0)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise IndexError(f"linear_cross_entropy_split: target {bad} is outside the vocabulary "
                         f"of {vocab} (ignore_index {ignore_index} aside)")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, count = _SplitLinearCrossEntropy.apply(hidden, weight, target.contiguous(), int(start),
                                                 group, ignore_index, chunk, with_grad)
    return loss / count
