"""Ring attention (context parallelism) on unmodified Hugging Face models.

The sequence is cut into 2n chunks and rank r keeps chunks r and 2n-1-r ("zigzag"), so
under a causal mask every rank does the same amount of work. Attention passes the K/V
blocks around the ring (n - 1 shifts to the next rank); each step adds that block's
contribution with the online-softmax rule (running max and sum per query). The ring
shift is differentiable (its backward shifts the gradients the other way), so autograd
builds the backward pass from the same steps. Causal language models without padding
masks; the implementation is registered through transformers' ``AttentionInterface``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...core import collectives as C
from ...core.errors import SpecError
from .._seqsplit import install_split
from ._ulysses import _route_attention, sp_group

NAME = "meshlab_ring"


def _shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    """Send ``x`` ``step`` ranks ahead on the ring, receive from ``step`` ranks behind."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)   # contiguous, unlike x
    ops = [dist.P2POp(dist.isend, x.contiguous(), ranks[(r + step) % n], group),
           dist.P2POp(dist.irecv, out, ranks[(r - step) % n], group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, g):
        return _shift(g, ctx.group, -1), None


def zigzag_positions(rank: int, n: int, seq: int) -> torch.Tensor:
    """Global positions of the tokens rank ``rank`` keeps (chunks r and 2n-1-r)."""
    c = seq // (2 * n)
    a = torch.arange(rank * c, (rank + 1) * c)
    b = torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)
    return torch.cat([a, b])


def zigzag_order(n: int, seq: int) -> torch.Tensor:
    return torch.cat([zigzag_positions(r, n, seq) for r in range(n)])


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """(B, H, S/n, D) per rank, zigzag chunks -> causal attention over the whole sequence."""
    group = sp_group(module)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    local = query.shape[2]
    seq = local * n
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_pos = zigzag_positions(r, n, seq).to(query.device)
    # scores and the running softmax in float32 at least: float64 inputs stay float64
    acc = torch.promote_types(query.dtype, torch.float32)
    m_acc = l_acc = o_acc = None
    k, v = key, value
    for step in range(n):
        src = (r - step) % n                      # whose K/V this is
        kv_pos = zigzag_positions(src, n, seq).to(query.device)
        allowed = kv_pos.unsqueeze(0) <= q_pos.unsqueeze(1)            # (Sq, Sk)
        s = torch.matmul(query, k.transpose(-1, -2)).to(acc) * scale    # (B, H, Sq, Sk)
        s = s.masked_fill(~allowed, float("-inf"))
        m_b = s.amax(dim=-1)
        m_b_safe = torch.where(torch.isfinite(m_b), m_b, torch.zeros_like(m_b))
        p = torch.exp(s - m_b_safe.unsqueeze(-1))
        l_b = p.sum(-1)
        o_b = torch.matmul(p, v.to(acc))
        if m_acc is None:
            m_acc, l_acc, o_acc = m_b_safe, l_b, o_b
        else:
            m_new = torch.maximum(m_acc, m_b_safe)
            a, b = torch.exp(m_acc - m_new), torch.exp(m_b_safe - m_new)
            l_acc = l_acc * a + l_b * b
            o_acc = o_acc * a.unsqueeze(-1) + o_b * b.unsqueeze(-1)
            m_acc = m_new
        if step < n - 1:
            k, v = _RingShift.apply(k, group), _RingShift.apply(v, group)
    out = (o_acc / l_acc.unsqueeze(-1)).to(query.dtype)                # (B, H, Sq, D)
    return out.transpose(1, 2).contiguous(), None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, dim):
        ctx.order, ctx.dim = order, dim
        return x.index_select(dim, order)

    @staticmethod
    def backward(ctx, g):
        inv = torch.empty_like(ctx.order)
        inv[ctx.order] = torch.arange(len(ctx.order), device=ctx.order.device)
        return g.index_select(ctx.dim, inv), None, None


def _zigzag_split(x: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if x.shape[1] % (2 * n):
        raise SpecError(f"sequence(ring): sequence length {x.shape[1]} does not divide into "
                        f"{2 * n} chunks (2 per rank, for causal load balance); pad it to a "
                        f"multiple of {2 * n}")
    order = zigzag_order(n, x.shape[1]).to(x.device)
    return C.split_seq(_Permute.apply(x, order, 1), group, 1)


def install(model: nn.Module, blocks: tuple[str, ...], group) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    _route_attention(model, blocks, group, NAME)
    n = dist.get_world_size(group)

    def gather(h):
        full = C.gather_seq_replicated(h, group, 1)
        order = zigzag_order(n, full.shape[1]).to(full.device)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(len(order), device=order.device)
        return _Permute.apply(full, inv, 1)

    install_split(model, blocks, lambda h: _zigzag_split(h, group), gather)
