"""Triton kernel of ``meshlab::paged_attention`` for decoding on CUDA.

Mirrors ``paged_attention_fwd`` of ``csrc/attention_cpu.cpp`` (same name, same arguments):
packed queries ``q`` (T, Hq, D; its tokens may be strided, as the query part of a merged
query/key/value product is), the paged caches (blocks, block_size, Hkv, D), the block
tables (S, W), each query's sequence ``seq`` (T,) and the number of keys it sees ``keys``
(T,), all on the device, so a decode step captured in a CUDA graph runs it unchanged.

One program per (query, kv head, share of the keys): it holds that kv head's group of
query heads as the rows of one tile and walks its share of the sequence's keys ``BLOCK_N``
at a time, each key's slot found through the block table, with an online softmax in
float32. Small batches cut each query's keys into shares (flash-decoding): one query and
8 kv heads are 8 programs on a device of 132 SMs, each walking all the keys in turn, so
the shares' sums go to a float32 buffer, and the share of a query that finishes last
(a counter per query and kv head, released and acquired around the sums) combines them in
the same launch. Batches with programs enough for the device run one share, written as
the output directly. Scores use
the inputs' precision for the products (float32 inputs:
IEEE, not TF32) and float32 accumulation. The query tile is padded to 16 rows for the
tensor cores; the padding rows read nothing.

It pays where each sequence has a few queries (decode, speculative verification); a
prefill, with many queries per sequence, is compute-bound and runs the SDPA path, where
the keys a query tile reads are shared by its rows (``paged_attention_op`` picks).

``write_kv`` stores a step's new keys and values in the caches in one launch (two
``index_copy_`` calls otherwise), reading them at their strides: the values of a merged
query/key/value product are a strided view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import _after_previous, chained, counters, sm_count


@triton.jit
def _attend(Q, K, V, TABLES, t, h, s, lo, hi, scale, QT, Hkv, W, BS, D,
            G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # kv head h's query rows of token t over keys lo .. hi - 1: the running maximum, sum of
    # exponentials and unnormalized output, float32.
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    qmask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(Q + t * QT + (h * G + g[:, None]) * D + d[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in tl.range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        valid = offs < hi
        blk = tl.load(TABLES + s * W + offs // BS, mask=valid, other=0).to(tl.int64)
        row = ((blk * BS + offs % BS) * Hkv + h) * D
        kvmask = valid[:, None] & (d[None, :] < D)
        k = tl.load(K + row[:, None] + d[None, :], mask=kvmask, other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(valid[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + row[:, None] + d[None, :], mask=kvmask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _combine(P, M, L, O, first, shares, SPLITS, D, G: tl.constexpr, BLOCK_GC: tl.constexpr,
             BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    # Output rows first .. first + G - 1 from their first `shares` shares' sums, BLOCK_C
    # shares a load, rescaled to a running maximum (one pass: a step's few shares are one
    # load). The sums were written by other programs: read from L2 (.cg), not from this
    # multiprocessor's L1.
    g = tl.arange(0, BLOCK_GC)
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    rows = (first + g) * SPLITS
    mx = tl.full([BLOCK_GC], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_GC], tl.float32)
    acc = tl.zeros([BLOCK_GC, BLOCK_D], tl.float32)
    for c0 in tl.range(0, shares, BLOCK_C):
        idx = rows[:, None] + c0 + c[None, :]
        msk = (g[:, None] < G) & (c0 + c[None, :] < shares)
        m = tl.load(M + idx, mask=msk, other=float("-inf"), cache_modifier=".cg")
        lsum = tl.load(L + idx, mask=msk, other=0.0, cache_modifier=".cg")
        part = tl.load(P + idx[:, :, None] * D + d[None, None, :],
                       mask=msk[:, :, None] & (d[None, None, :] < D), other=0.0,
                       cache_modifier=".cg")
        m_new = tl.maximum(mx, tl.max(m, axis=1))
        alpha = tl.exp(mx - m_new)                  # 0 on the first load
        w = tl.where(msk, tl.exp(m - m_new[:, None]), 0.0)
        den = den * alpha + tl.sum(lsum * w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], axis=1)
        mx = m_new
    out = acc / den[:, None]
    tl.store(O + (first + g[:, None]) * D + d[None, :], out.to(O.dtype.element_ty),
             mask=(g[:, None] < G) & (d[None, :] < D))


@triton.jit
def _store_new(K, V, KN, VN, SLOTS, t, h, Hkv, D, KNT, KNH, VNT, VNH, BLOCK_D: tl.constexpr):
    # Query t's own key and value of kv head h (its sequence's last key) into its slot of
    # the caches, before this program reads them back with the rest.
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(SLOTS + t).to(tl.int64)
    dst = (slot * Hkv + h) * D + d
    kn = tl.load(KN + t * KNT + h * KNH + d, mask=d < D)
    vn = tl.load(VN + t * VNT + h * VNH + d, mask=d < D)
    tl.store(K + dst, kn.to(K.dtype.element_ty), mask=d < D)
    tl.store(V + dst, vn.to(V.dtype.element_ty), mask=d < D)
    tl.debug_barrier()          # the stores before any thread of the program reads them


@triton.jit
def _paged_decode(Q, K, V, TABLES, SEQ, KEYS, O, P, M, L, COUNT, KN, VN, SLOTS, scale, QT, Hq,
                  Hkv, W, BS, D, SPLITS, KNT, KNH, VNT, VNH, G: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_GC: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                  SPLIT: tl.constexpr, WRITE: tl.constexpr, PDL: tl.constexpr):
    # WRITE: every query is its sequence's only one this step (a decode step), and its key
    # and value (KN, VN at their strides) are stored at SLOTS here, by the program whose
    # keys end with them, instead of by a launch before.
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.load(SEQ + t).to(tl.int64)
    n = tl.load(KEYS + t)
    if SPLIT:
        # This program's share of the keys: whole tiles, the last share short; shares past
        # the keys do nothing. Each share's sums go to P, M, L; the program that finishes
        # last among the query's shares (a counter per (query, kv head), back to 0 after)
        # combines them into the output, so no second launch is needed.
        per = tl.maximum(tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
        shares = tl.cdiv(n, per)
        lo = tl.program_id(2) * per
        if WRITE:
            if (n - 1) // per == tl.program_id(2):
                _store_new(K, V, KN, VN, SLOTS, t, h, Hkv, D, KNT, KNH, VNT, VNH, BLOCK_D)
        if lo < n:
            m_i, l_i, acc = _attend(Q, K, V, TABLES, t, h, s, lo, tl.minimum(n, lo + per),
                                    scale, QT, Hkv, W, BS, D, G, BLOCK_G, BLOCK_D, BLOCK_N,
                                    IEEE)
            g = tl.arange(0, BLOCK_G)
            d = tl.arange(0, BLOCK_D)
            r = (t * Hq + h * G + g) * SPLITS + tl.program_id(2)
            tl.store(M + r, m_i, mask=g < G)
            tl.store(L + r, l_i, mask=g < G)
            tl.store(P + r[:, None] * D + d[None, :], acc,
                     mask=(g[:, None] < G) & (d[None, :] < D))
            tl.debug_barrier()          # every thread's stores before the release below
            counter = COUNT + t * Hkv + h
            if tl.atomic_add(counter, 1, sem="acq_rel") == shares - 1:
                tl.store(counter, 0)
                _combine(P, M, L, O, t * Hq + h * G, shares, SPLITS, D, G, BLOCK_GC,
                         BLOCK_C, BLOCK_D)
    else:
        if WRITE:
            _store_new(K, V, KN, VN, SLOTS, t, h, Hkv, D, KNT, KNH, VNT, VNH, BLOCK_D)
        m_i, l_i, acc = _attend(Q, K, V, TABLES, t, h, s, 0, n, scale, QT, Hkv, W, BS, D, G,
                                BLOCK_G, BLOCK_D, BLOCK_N, IEEE)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        out = acc / l_i[:, None]
        tl.store(O + (t * Hq + h * G + g[:, None]) * D + d[None, :], out.to(O.dtype.element_ty),
                 mask=(g[:, None] < G) & (d[None, :] < D))


def splits_for(t: int, hkv: int, max_keys: int, block_n: int, device) -> int:
    """How many shares to cut each query's keys into: enough (query, kv head, share)
    programs to fill the device about twice, no more shares than tiles of keys the tables
    can hold. It depends on the tables' width, not on the keys a step has, so a captured
    graph keeps its launch shape as the sequences grow."""
    fill = triton.cdiv(2 * sm_count(device), t * hkv)
    return max(1, min(fill, triton.cdiv(max_keys, block_n), 64))


def stores_kv(k_cache, v_cache, slots, k, v) -> bool:
    """Whether these kernels can store ``k``, ``v`` (T, Hkv, D) at ``slots`` of the caches
    (:func:`write_kv`, or :func:`paged_attention_fwd` with ``new``): contiguous caches of
    their dtype, unit strides along the head dim, contiguous slots."""
    return (k_cache.is_contiguous() and v_cache.is_contiguous() and k.stride(-1) == 1
            and v.stride(-1) == 1 and slots.is_contiguous() and k_cache.dtype == k.dtype
            and v_cache.dtype == v.dtype)


def paged_attention_fwd(q, k_cache, v_cache, tables, seq, keys, scale, splits=None,
                        new=None):
    """(T, Hq, D) attention of each packed query over its sequence's first ``keys[t]`` keys;
    ``splits``: shares of the keys per query (default :func:`splits_for`); more than one
    runs flash-decoding, the last share of each query to finish combining them. ``new``:
    (k, v, slots) of a decode step (each query its sequence's only one, its key and value
    its sequence's last), stored into the caches by the same launch (:func:`stores_kv`
    must hold; the caches are then written in place)."""
    t, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    if q.stride(-1) != 1 or q.stride(1) != d:       # tokens may be strided, heads not
        q = q.contiguous()
    if new is None:
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        kn = vn = slots = q
        kns = vns = (0, 0)
    else:
        kn, vn, slots = new
        kns, vns = kn.stride()[:2], vn.stride()[:2]
    tables = tables.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    g = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    # Keys per iteration: a whole number of the cache's blocks where they are small, so
    # the table read of a tile touches one or two entries.
    block_n = 64 if block_d <= 128 else 32
    if splits is None:
        splits = splits_for(t, hkv, tables.shape[1] * bs, block_n, q.device)
    block_gc = max(2, triton.next_power_of_2(g))
    common = dict(G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_GC=block_gc,
                  BLOCK_C=max(2, min(16, 64 // block_gc)), BLOCK_D=block_d,
                  BLOCK_N=block_n, IEEE=q.dtype == torch.float32, WRITE=new is not None,
                  num_warps=4, num_stages=2, **chained(q.device))
    if splits == 1:
        _paged_decode[(t, hkv, 1)](q, k_cache, v_cache, tables, seq, keys, out, out, out, out,
                                   out, kn, vn, slots, float(scale), q.stride(0), hq, hkv,
                                   tables.shape[1], bs, d, 1, *kns, *vns, SPLIT=False,
                                   **common)
        return out
    part = torch.empty(t, hq, splits, d, device=q.device, dtype=torch.float32)
    m = torch.empty(t, hq, splits, device=q.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    _paged_decode[(t, hkv, splits)](q, k_cache, v_cache, tables, seq, keys, out, part, m,
                                    lsum, counters(t * hkv, q.device, "paged"), kn, vn, slots,
                                    float(scale), q.stride(0), hq, hkv, tables.shape[1], bs,
                                    d, splits, *kns, *vns, SPLIT=True, **common)
    return out


@triton.jit
def _write_kv(K, V, KC, VC, SLOTS, KT, KH, VT, VH, HKV, D, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    # One program per (token, keys or values): all its heads, to the token's slot.
    _after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    dst = slot * HKV * D + h * D + d
    if which == 0:
        x = tl.load(K + t * KT + h * KH + d, mask=mask)
        tl.store(KC + dst, x.to(KC.dtype.element_ty), mask=mask)
    else:
        x = tl.load(V + t * VT + h * VH + d, mask=mask)
        tl.store(VC + dst, x.to(VC.dtype.element_ty), mask=mask)


def write_kv(k_cache, v_cache, slots, k, v) -> bool:
    """Store ``k``, ``v`` (T, Hkv, D) at flat ``slots`` (T,) of the contiguous caches; False
    (nothing written) where the layouts do not suit the kernel."""
    t, hkv, d = k.shape
    if not stores_kv(k_cache, v_cache, slots, k, v):
        return False
    if t:
        bh, bd = triton.next_power_of_2(hkv), triton.next_power_of_2(d)
        _write_kv[(t, 2)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0),
                          v.stride(1), hkv, d, BLOCK_H=bh, BLOCK_D=bd,
                          num_warps=4 if bh * bd <= 2048 else 8, **chained(k.device))
    return True
