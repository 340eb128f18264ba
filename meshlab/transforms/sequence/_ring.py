"""Ring attention (context parallelism) on unmodified Hugging Face models.

The sequence is cut into 2n chunks and rank r keeps chunks r and 2n-1-r ("zigzag"), so
under a causal mask every rank does the same amount of work. The K/V blocks pass around
the ring (n - 1 shifts to the next rank, each posted before the step's compute so it
overlaps it, each carrying the K/V heads only: grouped-query heads are not expanded).
Each query chunk meets each K/V chunk as one flash-style block (``meshlab::attention``,
which returns the rows' log-sum-exp; a chunk after the query's is skipped, the same chunk
is causal), and the blocks are joined by their log-sum-exps. Memory: the backward keeps
q, k, v, the output and the log-sum-exps, O(S/n x D) per rank, and recomputes each block
(``meshlab::attention_backward``), the K/V gradients travelling with their blocks back to
their owner, so no (S/n)^2 score block outlives its step. Causal language models;
registered through transformers' ``AttentionInterface`` and its SDPA mask function.
Padded and packed batches: the model's mask of the whole sequence is read as causal
attention within segments (``ops._attention_hf.causal_segments``; any other mask is refused),
and each block pair (a query chunk, a K/V chunk) is masked with the segment ids of its
positions; a pair in which no query sees any key is skipped, and a row that sees no key
of a block joins the merge with weight 0 (log-sum-exp -inf). The ring is a
pair of custom ops (``meshlab_comm::ring_attention`` and its backward), so a block attending
through it compiles whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...core import collectives as C
from ...core.errors import ConfigError, SpecError
from ... import ops as _ops  # noqa: F401  (registers meshlab::attention)
from ...ops._attention_hf import as_autocast
from .._seqsplit import install_split
from ._ulysses import _route_attention, register_mask, sp_group

NAME = "meshlab_ring"


class _Shift:
    """Tensors on their way one rank ahead on the ring (what arrives: from one behind).

    Posted before the step's compute and waited for after it, so each shift overlaps the
    block attention it is not needed by."""

    def __init__(self, tensors, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), ranks[(r + 1) % n], group)
               for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, ranks[(r - 1) % n], group) for g in self.got]
        self.reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list:
        for req in self.reqs:
            req.wait()
        return self.got


def zigzag_positions(rank: int, n: int, seq: int) -> torch.Tensor:
    """Global positions of the tokens rank ``rank`` keeps (chunks r and 2n-1-r)."""
    c = seq // (2 * n)
    a = torch.arange(rank * c, (rank + 1) * c)
    b = torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)
    return torch.cat([a, b])


def zigzag_order(n: int, seq: int) -> torch.Tensor:
    return torch.cat([zigzag_positions(r, n, seq) for r in range(n)])


# -- one block: a query chunk against one K/V chunk -----------------------------------------
def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _seen(causal: bool, qs, ks, n: int, device):
    """Which keys of a block each query sees, (B, 1, c, c) or (c, c); None: all."""
    seen = torch.ones(n, n, dtype=torch.bool, device=device).tril() if causal else None
    if qs is not None:
        same = (qs[:, None, :, None] == ks[:, None, None, :])
        seen = same if seen is None else same & seen
    return seen


def _block(q, k, v, causal: bool, scale: float, qs=None, ks=None):
    """(out, lse) of query chunk ``q`` over one K/V chunk (grouped heads as they are),
    ``qs``/``ks`` the segment ids of their positions (or None): ``meshlab::attention``
    (its C++ kernel on the CPU, cuDNN on CUDA); in float64 the same math in float64, since
    the op's log-sum-exp is float32 and the merge would round. A row that sees no key
    gives 0 and lse -inf."""
    if q.dtype != torch.float64:
        out, lse = torch.ops.meshlab.attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                               causal, scale, qs, ks)
        if qs is not None:          # rows with no key of this block: weight 0 in the merge
            none = ~_seen(causal, qs, ks, q.shape[2], q.device).any(-1)        # (B, 1, c)
            out = out.masked_fill(none[..., None], 0.0)
            lse = lse.masked_fill(none, float("-inf"))
        return out, lse
    g = q.shape[1] // k.shape[1]
    s = (q @ _expand(k, g).transpose(-1, -2)) * scale
    seen = _seen(causal, qs, ks, q.shape[2], q.device)
    if seen is not None:
        s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    if seen is not None:
        p = p.masked_fill(~seen, 0.0)
    return p @ _expand(v, g), lse


def _block_grad(dout, q, k, v, out, lse, causal: bool, scale: float, qs=None, ks=None):
    """(dq, dk, dv) of one block given the whole row's ``out`` and ``lse`` (flash
    attention's backward: the probabilities recomputed from the global log-sum-exp)."""
    if q.dtype != torch.float64:
        return torch.ops.meshlab.attention_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.contiguous(), lse.float().contiguous(), causal, scale, qs, ks)
    g = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, g), _expand(v, g)
    s = (q @ ke.transpose(-1, -2)) * scale
    seen = _seen(causal, qs, ks, q.shape[2], q.device)
    if seen is not None:
        s = s.masked_fill(~seen, float("-inf"))
    p = torch.exp(s - lse[..., None])
    if seen is not None:
        p = p.masked_fill(~seen, 0.0)
    dv = p.transpose(-1, -2) @ dout
    dp = dout @ ve.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) * scale
    dq, dk = ds @ ke, ds.transpose(-1, -2) @ q
    if g > 1:
        b, h, s_, d = dk.shape
        dk = dk.view(b, h // g, g, s_, d).sum(2)
        dv = dv.view(b, h // g, g, s_, d).sum(2)
    return dq, dk, dv


def _merge(acc, o, lse):
    """Two partial attentions of the same rows joined by their log-sum-exps (a row with
    lse -inf on one side, which saw no key there, takes the other side whole; on both,
    it stays 0 with lse -inf)."""
    if acc is None:
        return o.to(torch.promote_types(o.dtype, torch.float32)), lse
    o_acc, l_acc = acc
    new = torch.logaddexp(l_acc, lse)
    empty = new == float("-inf")
    w_acc = torch.exp(l_acc - new).masked_fill(empty, 0.0)
    w = torch.exp(lse - new).masked_fill(empty, 0.0)
    return o_acc * w_acc[..., None] + o.to(o_acc.dtype) * w[..., None], new


def _chunk_segments(segments, chunk: int, c: int):
    """Segment ids (B, c) of the positions of zigzag chunk ``chunk`` (None: no segments)."""
    return None if segments is None else segments[:, chunk * c:(chunk + 1) * c]


def _meets(causal: bool, qs, ks) -> bool:
    """Whether any query of a block pair sees any key (always, without segments)."""
    if qs is None:
        return True
    return bool(_seen(causal, qs, ks, qs.shape[1], qs.device).any())


def _pairs(r: int, src: int, n: int):
    """The (query half, K/V half, causal) blocks rank ``r`` computes against the K/V of
    rank ``src``: each holds chunks (i, 2n-1-i); a K/V chunk after the query chunk is
    skipped, the same chunk is causal, an earlier one is whole."""
    ids_q, ids_k = (r, 2 * n - 1 - r), (src, 2 * n - 1 - src)
    return [(a, b, ids_k[b] == ids_q[a]) for a in (0, 1) for b in (0, 1)
            if ids_k[b] <= ids_q[a]]


def _ring_forward(q, k, v, group, scale: float, segments=None):
    """(out, row log-sum-exps) of causal attention of this rank's two zigzag chunks over
    the whole sequence, the K/V of every rank passing once around the ring; ``segments``
    (B, S) the whole sequence's segment ids in its own order, or None."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    qs = (q[:, :, :c], q[:, :, c:])
    acc = [None, None]
    kv = [k, v]
    for step in range(n):
        ahead = _Shift(kv, group) if step < n - 1 else None
        ks, vs = (kv[0][:, :, :c], kv[0][:, :, c:]), (kv[1][:, :, :c], kv[1][:, :, c:])
        src = (r - step) % n
        for a, b, causal in _pairs(r, src, n):
            sq = _chunk_segments(segments, (r, 2 * n - 1 - r)[a], c)
            sk = _chunk_segments(segments, (src, 2 * n - 1 - src)[b], c)
            if not _meets(causal, sq, sk):
                continue              # no query of the pair sees a key: nothing to add
            o, lse = _block(qs[a], ks[b], vs[b], causal, scale, sq, sk)
            acc[a] = _merge(acc[a], o, lse)
        if ahead is not None:
            kv = ahead.wait()
    out = torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
    lse = torch.cat([acc[0][1], acc[1][1]], dim=2)
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, group, scale: float, segments=None):
    """(dq, dk, dv): each block recomputed from the saved log-sum-exps, the K/V gradients
    travelling with their blocks back to their owner."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    wide = torch.promote_types(q.dtype, torch.float32)
    halves = lambda t: (t[:, :, :c], t[:, :, c:])    # noqa: E731
    qs, outs, lses, douts = halves(q), halves(out), halves(lse), halves(dout)
    dq = torch.zeros(q.shape, dtype=wide, device=q.device)
    kv = [k, v]
    dkv = [torch.zeros(k.shape, dtype=wide, device=k.device),
           torch.zeros(v.shape, dtype=wide, device=v.device)]
    for step in range(n):
        ahead = _Shift(kv, group) if step < n - 1 else None
        ks, vs = halves(kv[0]), halves(kv[1])
        src = (r - step) % n
        for a, b, causal in _pairs(r, src, n):
            sq = _chunk_segments(segments, (r, 2 * n - 1 - r)[a], c)
            sk = _chunk_segments(segments, (src, 2 * n - 1 - src)[b], c)
            if not _meets(causal, sq, sk):
                continue
            g = _block_grad(douts[a], qs[a], ks[b], vs[b], outs[a], lses[a], causal, scale,
                            sq, sk)
            dq[:, :, a * c:(a + 1) * c] += g[0]
            dkv[0][:, :, b * c:(b + 1) * c] += g[1]
            dkv[1][:, :, b * c:(b + 1) * c] += g[2]
        back = _Shift(dkv, group)      # the K/V gradients follow their blocks home
        if ahead is not None:
            kv = ahead.wait()
        dkv = back.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# The ring as two custom ops (its forward and its backward, joined by register_autograd):
# opaque to dynamo, so blocks that attend through the ring compile whole
# (``compile_blocks``), the point-to-point shifts running inside the op. The process group
# travels by name, as torch's functional collectives pass it. Their namespace is
# ``meshlab_comm`` (ops that communicate), apart from ``meshlab``'s kernels, which
# tests/ops holds on every input layout in one process; these are trained on gloo
# (tests/transforms/sequence, and the table's ring cases).
def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _forward_named(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                   scale: float, segments: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal ring attention of this rank's zigzag chunks: (out, row log-sum-exps);
    ``segments`` (B, S): the whole sequence's segment ids (its own order), or None."""
    return _ring_forward(q, k, v, _group(group_name), scale, segments)


def _backward_named(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, group_name: str, scale: float,
                    segments: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(dout, q, k, v, out, lse, _group(group_name), scale, segments)


ring_attention = torch.library.custom_op("meshlab_comm::ring_attention",
                                         mutates_args=())(_forward_named)


@ring_attention.register_fake
def _(q, k, v, group_name, scale, segments=None):
    return (q.new_empty(q.shape),
            q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32)))


ring_attention_backward = torch.library.custom_op("meshlab_comm::ring_attention_backward",
                                                  mutates_args=())(_backward_named)


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, group_name, scale, segments=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, group_name, scale, *segments = inputs
    ctx.save_for_backward(q, k, v, *output, segments[0] if segments else None)
    ctx.group_name, ctx.scale = group_name, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, segments = ctx.saved_tensors
    dq, dk, dv = torch.ops.meshlab_comm.ring_attention_backward(
        dout.contiguous(), q, k, v, out, lse, ctx.group_name, ctx.scale, segments)
    return dq, dk, dv, None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup)
C.COMMUNICATING_OPS.update({"meshlab_comm::ring_attention": _forward_named,
                            "meshlab_comm::ring_attention_backward": _backward_named})


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """(B, H, S/n, D) per rank, zigzag chunks -> causal attention over the whole sequence
    (returned as (B, S/n, H, D), as transformers' attention functions return it). K/V keep
    their own (grouped) head count on the ring. ``attention_mask``: None, or the model's
    4-D mask of the whole sequence (padded or packed rows), read as causal segments."""
    out = over_ring(query, key, value, attention_mask, scaling, dropout, sp_group(module))
    return out.transpose(1, 2).contiguous(), None


def over_ring(query, key, value, attention_mask, scaling, dropout, group) -> torch.Tensor:
    """The ring op on this rank's zigzag chunks, (B, H, S/n, D) in and out; the mask read
    as causal segments of the whole sequence (or refused by name)."""
    if dropout:
        raise ConfigError(f"sequence(ring): attention dropout {dropout} is not computed by "
                          f"ring attention; set the model's attention_dropout to 0")
    segments = None
    if attention_mask is not None:
        segments = _segments_of(attention_mask, query.shape[2] * dist.get_world_size(group))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value = _one_dtype(query, key, value)
    with torch.autocast(query.device.type, enabled=False):
        out, _ = torch.ops.meshlab_comm.ring_attention(query.contiguous(), key.contiguous(),
                                                  value.contiguous(), group.group_name,
                                                  float(scale), segments)
    return out


def _segments_of(mask, s: int):
    """Segment ids (B, S) of the model's whole-sequence mask (``ops._attention_hf``'s reading,
    once per mask); a mask that is not causal within segments is refused by name."""
    from ...ops._attention_hf import _describe, _segments_of as read

    seg = read(mask) if isinstance(mask, torch.Tensor) and mask.dim() == 4 and \
        tuple(mask.shape[-2:]) == (s, s) else None
    if seg is None:
        raise ConfigError(f"sequence(ring): the model handed its attention a "
                          f"{_describe(mask)} mask that is not causal within segments (padded "
                          f"rows, packed samples) of the whole sequence ({s} tokens): ring "
                          f"attention masks those only; a sliding window or a custom mask "
                          f"needs shard() or data parallelism")
    return seg


PROFILE_NAME = "meshlab_ring_profile"


def profile_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """What :func:`attention` keeps, on one process and at the whole sequence, for the
    activation profile (``Sequence.profile``; the room divides it by the axis). The ring op
    saves q, k and v as it got them (K/V with their own heads), its
    output (B, H, S, D) in q's dtype and the float32 row log-sum-exps, as SDPA's fused
    kernel (grouped heads unexpanded) saves them here; that output is contiguous, so its
    transpose for o_proj is a second copy, which o_proj keeps (SDPA's output is laid out
    so that its transpose is not: the copy is made explicitly). No (S x S) block is kept:
    the model's own eager attention, which the profile would otherwise run, is not what
    the ring runs.

    Not reproduced: what the ring allocates only while it runs. In the forward, the K/V
    block arriving from the previous rank, the contiguous halves each block reads and the
    float32 output and log-sum-exp accumulators of the two query chunks; in the backward,
    which recomputes every block from the saved log-sum-exps, float32 accumulators for dq,
    dk and dv, the K/V blocks and their float32 gradients in flight, and each block's
    halves and gradients: all O(S/n x D), about seven times the attention's output in
    float32 at the backward's height, alive only inside the attention, when the block's
    MLP activations and the whole-sequence final norm and head of the backward are freed
    already. The step's peak is not there (with hidden 128, 2 ranks and S = 4096 the
    backward's ring peaked at 17.6 MiB alive, the final norm's backward at 31.7)."""
    query, key, value = _one_dtype(query, key, value)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).clone(memory_format=torch.contiguous_format), None


def _one_dtype(q, k, v):
    """q, k and v in one dtype, as SDPA takes them: autocast's (``as_autocast``; the ring
    is a custom op autocast does not see), else the three promoted to one."""
    q, k, v = as_autocast(q, k, v)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


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


def _zigzag_gather(h: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence, in its own order, from every rank's zigzag chunks."""
    full = C.gather_seq_replicated(h, group, 1)
    order = zigzag_order(dist.get_world_size(group), full.shape[1]).to(full.device)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(len(order), device=order.device)
    return _Permute.apply(full, inv, 1)


def install(model: nn.Module, blocks: tuple[str, ...], group, held: frozenset) -> None:
    """Attention over ``group`` in the ``held`` blocks (this rank's, of the model's
    ``blocks``), the sequence split before the model's first block and joined after its
    last (``install_split``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    register_mask(NAME)
    _route_attention(model, tuple(b for b in blocks if b in held), group, NAME)
    install_split(model, blocks, lambda h: _zigzag_split(h, group),
                  lambda h: _zigzag_gather(h, group), held)
