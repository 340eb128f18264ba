"""Attention of packed queries over a paged key/value cache, for decoding.

The cache of one layer is two tensors ``k_cache``, ``v_cache`` of shape
``(num_blocks, block_size, Hkv, D)``; a sequence's keys live in the blocks its row of
``block_tables`` (S, max_blocks) names, in order, ``seq_lens[s]`` of them. The queries of
all S sequences are packed along one axis: ``q`` is ``(T, Hq, D)`` and sequence ``s`` owns
rows ``query_start[s]:query_start[s + 1]``, its last tokens (a prompt being filled, or one
token being decoded). Query ``i`` of a sequence with ``n`` keys and ``m`` queries sits at
position ``n - m + i`` and attends to keys ``0 .. n - m + i`` (causal). ``Hq`` is a
multiple of ``Hkv`` (grouped-query attention: query head ``h`` reads kv head
``h // (Hq // Hkv)``). The output is ``(T, Hq, D)`` in ``q.dtype``; scores and softmax run in
float32, or in float64 for float64 inputs.

Registered as ``meshlab::paged_attention`` (no autograd: decoding has no backward), with a
fake kernel for tracing. On the CPU, for float32 and bfloat16 with the cache in the
queries' dtype, it is the C++ kernel in ``csrc/attention_cpu.cpp``: one task per query
and kv head (its query heads together), reading that sequence's keys and values through
its block table (nothing gathered or padded), float32 scores and softmax. On CUDA the
Triton kernel in ``_triton_paged.py`` does the same for batches of at most
:data:`DECODE_QUERIES` queries per sequence (decode steps), with the cache in the queries'
dtype. Elsewhere (a prefill on CUDA, other dtypes, a cache
in another dtype, kernels off) it gathers every sequence's blocks at once
(``k_cache[block_tables]``), pads the queries per sequence and runs one
``scaled_dot_product_attention`` with the causal-per-sequence mask (grouped-query heads
native). ``meshlab.ops._build.LAST_PATH`` says which ran. :func:`paged_attention_reference`
is the same per sequence, in float32 math, for the tests. ``seq_lens`` and ``query_start`` are host integer lists (the scheduler knows
them), so no device read is needed to find the blocks.

>>> import torch
>>> from meshlab.ops.paged_attention import paged_attention
>>> kc, vc = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)   # 4 blocks of 2 slots, 1 kv head
>>> tables = torch.tensor([[2, 0], [1, 3]])                      # sequence 0: blocks 2, 0
>>> q = torch.randn(3, 2, 8)                 # seq 0 decodes 1 token, seq 1 fills 2 of its 3
>>> paged_attention(q, kc, vc, tables, [3, 3], [0, 1, 3]).shape
torch.Size([3, 2, 8])
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
           seq_lens: list[int], query_start: list[int]) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"meshlab::paged_attention: q must be (T, Hq, D) and both caches "
                         f"(blocks, block_size, Hkv, D); got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    hq, d = q.shape[1:]
    hkv, dk = k_cache.shape[2:]
    if dk != d or hq % hkv:
        raise ValueError(f"meshlab::paged_attention: q has {hq} heads of {d}, the cache {hkv} "
                         f"heads of {dk}; the head dims must match and {hkv} divide {hq}")
    s = len(seq_lens)
    if len(query_start) != s + 1 or query_start[-1] != q.shape[0] or block_tables.dim() != 2 \
            or block_tables.shape[0] < s:
        raise ValueError(f"meshlab::paged_attention: {s} sequences need query_start of {s + 1} "
                         f"offsets ending at T={q.shape[0]} and a block table per sequence; "
                         f"got query_start={query_start}, block_tables "
                         f"{tuple(block_tables.shape)}")
    bs = k_cache.shape[1]
    for i, n in enumerate(seq_lens):
        m = query_start[i + 1] - query_start[i]
        if m > n or math.ceil(n / bs) > block_tables.shape[1]:
            raise ValueError(f"meshlab::paged_attention: sequence {i} has {m} queries and {n} "
                             f"keys; it needs queries <= keys and ceil({n}/{bs}) blocks in "
                             f"its table of {block_tables.shape[1]}")


def paged_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                              block_tables: Tensor, seq_lens: list[int],
                              query_start: list[int], scale: float | None = None) -> Tensor:
    """Pure-PyTorch paged attention (module docstring): (T, Hq, D) -> (T, Hq, D)."""
    hq, d = q.shape[1:]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    for s, n in enumerate(seq_lens):
        a, b = query_start[s], query_start[s + 1]
        if a == b:
            continue
        blocks = block_tables[s, :math.ceil(n / bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].to(acc)          # (n, Hkv, D)
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].to(acc)
        qs = q[a:b].to(acc).view(b - a, hkv, hq // hkv, d)             # (m, Hkv, G, D)
        scores = torch.einsum("mhgd,nhd->hgmn", qs, k) * scale
        pos = torch.arange(n - (b - a), n, device=q.device)
        masked = torch.arange(n, device=q.device)[None, :] > pos[:, None]
        scores = scores.masked_fill(masked, float("-inf"))
        o = torch.einsum("hgmn,nhd->mhgd", scores.softmax(-1), v)
        out[a:b] = o.reshape(b - a, hq, d).to(q.dtype)
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each packed query sits, as device tensors (one per step, shared by layers):
    ``tables`` the block tables cut to the longest sequence's blocks, ``seq`` and ``row``
    each query's sequence and row among that sequence's queries, ``mask`` (S, 1, M, L)
    which keys each padded query row sees, ``keys`` (T,) how many keys each query sees
    (its causal prefix: what the kernels read)."""

    tables: Tensor
    seq: Tensor
    row: Tensor
    mask: Tensor
    keys: Tensor


def layout(block_tables: Tensor, seq_lens: list[int], query_start: list[int],
           block_size: int) -> Layout:
    """The :class:`Layout` of a packed batch (host lists in, device tensors out)."""
    dev = block_tables.device
    s = len(seq_lens)
    m = [query_start[i + 1] - query_start[i] for i in range(s)]
    width = math.ceil(max(seq_lens) / block_size)
    seq = torch.repeat_interleave(torch.arange(s), torch.tensor(m))
    row = torch.arange(query_start[-1]) - torch.tensor(query_start[:-1])[seq]
    # query i of sequence s sits at n_s - m_s + i and sees keys up to there
    pos = (torch.tensor(seq_lens) - torch.tensor(m))[:, None] + torch.arange(max(m))[None, :]
    mask = torch.arange(width * block_size)[None, None, :] <= pos[:, :, None]
    keys = pos[seq, row] + 1
    return Layout(block_tables[:s, :width].long(), seq.to(dev, non_blocking=True),
                  row.to(dev, non_blocking=True), mask[:, None].to(dev, non_blocking=True),
                  keys.to(dev, non_blocking=True))


# On CUDA the Triton kernel runs batches with at most this many queries per sequence
# (decode steps, speculative verification); a prefill runs one SDPA call.
DECODE_QUERIES = 16


@torch.library.custom_op("meshlab::paged_attention", mutates_args=())
def paged_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                       seq: Tensor, row: Tensor, mask: Tensor, keys: Tensor,
                       scale: float) -> Tensor:
    """The C++ kernel on the CPU (module docstring), else all sequences in one SDPA call:
    blocks gathered, queries padded to the longest."""
    import torch.nn.functional as F

    from . import _build

    dev = q.device.type
    if dev == "cuda" and mask.shape[2] > DECODE_QUERIES:
        _build.record("paged_attention", dev, False,
                      f"{mask.shape[2]} queries per sequence (a prefill): one SDPA call")
    elif dev in ("cpu", "cuda"):
        mod = _build.kernels("paged_attention", q)
        if mod is not None and k_cache.dtype != q.dtype:
            _build.record("paged_attention", dev, False,
                          f"the cache is {k_cache.dtype}, the queries {q.dtype}")
            mod = None
        if mod is not None:
            # Triton reads strided tokens (the query part of a merged product) in place.
            return mod.paged_attention_fwd(q if dev == "cuda" else q.contiguous(),
                                           k_cache.contiguous(),
                                           v_cache.contiguous(), tables.contiguous(),
                                           seq.contiguous(), keys.contiguous(), float(scale))

    hq, d = q.shape[1:]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    s, width = tables.shape
    k = k_cache[tables].reshape(s, width * bs, hkv, d).transpose(1, 2).to(q.dtype)
    v = v_cache[tables].reshape(s, width * bs, hkv, d).transpose(1, 2).to(q.dtype)
    qp = q.new_zeros(s, mask.shape[2], hq, d)
    qp[seq, row] = q
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask,
                                         scale=scale, enable_gqa=hq != hkv)
    return out.transpose(1, 2)[seq, row]


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, tables, seq, row, mask, keys, scale):
    return q.new_empty(q.shape)                  # contiguous, as the kernel's gather gives


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: list[int], query_start: list[int],
                    scale: float | None = None, where: Layout | None = None) -> Tensor:
    """``meshlab::paged_attention`` after checking the arguments (module docstring);
    ``where``: the batch's :func:`layout`, made once for all layers of a step."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if where is None:       # else the caller checked the batch once, for every layer
        seq_lens, query_start = [int(x) for x in seq_lens], [int(x) for x in query_start]
        _check(q, k_cache, v_cache, block_tables, seq_lens, query_start)
        where = layout(block_tables, seq_lens, query_start, k_cache.shape[1])
    return paged_attention_op(q, k_cache, v_cache, where.tables, where.seq, where.row,
                              where.mask, where.keys, scale)


@torch.library.custom_op("meshlab::paged_decode", mutates_args=("k_cache", "v_cache"))
def paged_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq: Tensor,
                    keys: Tensor, scale: float, k: Tensor, v: Tensor, slots: Tensor) -> Tensor:
    """A decode step's attention (each query its sequence's only one, in order): store each
    query's key and value ``k``, ``v`` (T, Hkv, D) at ``slots``, its sequence's last key,
    and attend over the sequence's ``keys``. On CUDA where ``_triton_paged.stores_kv``
    holds, the Triton kernel does both in one launch; elsewhere :func:`write_cache` and
    ``meshlab::paged_attention``."""
    from . import _build

    if q.is_cuda and k_cache.dtype == q.dtype:
        mod = _build.triton_kernels("paged_attention")
        if mod is not None and mod.stores_kv(k_cache, v_cache, slots, k, v):
            return mod.paged_attention_fwd(q, k_cache, v_cache, tables, seq, keys,
                                           float(scale), new=(k, v, slots))
    write_cache(k_cache, v_cache, slots, k, v)
    width = tables.shape[1] * k_cache.shape[1]
    mask = torch.zeros(tables.shape[0], 1, 1, width, dtype=torch.bool, device=q.device)
    mask[seq, 0, 0] = torch.arange(width, device=q.device)[None, :] < keys[:, None]
    return paged_attention_op(q, k_cache, v_cache, tables, seq, torch.zeros_like(seq), mask,
                              keys, float(scale))


@paged_decode_op.register_fake
def _(q, k_cache, v_cache, tables, seq, keys, scale, k, v, slots):
    return q.new_empty(q.shape)


def write_and_attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor,
                     v: Tensor, where: Layout, scale: float) -> Tensor:
    """:func:`write_cache` of the step's keys and values, then :func:`paged_attention` of
    its queries over the batch ``where`` (its layout, checked by the caller). On CUDA, when
    every sequence has one query (a decode step), ``meshlab::paged_decode`` (one launch for
    both where the Triton kernel applies)."""
    if q.is_cuda and where.mask.shape[2] == 1:
        return paged_decode_op(q, k_cache, v_cache, where.tables, where.seq, where.keys,
                               float(scale), k, v, slots)
    write_cache(k_cache, v_cache, slots, k, v)
    return paged_attention_op(q, k_cache, v_cache, where.tables, where.seq, where.row,
                              where.mask, where.keys, float(scale))


def write_cache(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Store the keys and values ``k``, ``v`` (T, Hkv, D) of T new tokens at flat slot
    indices ``slots`` (T,) (``block * block_size + offset``), in the caches' dtype."""
    if k.is_cuda:                       # one Triton launch for both, where it applies
        from . import _build

        mod = _build.triton_kernels("kv_cache_write")
        if mod is not None and mod.write_kv(k_cache, v_cache, slots, k, v):
            return
    hkv, d = k_cache.shape[2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))
