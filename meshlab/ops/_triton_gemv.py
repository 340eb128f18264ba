"""Triton matrix-vector product for one-row decode steps on CUDA: ``F.linear(x, w, b)``
for ``x`` of one row.

At batch 1 a decode step's products read each weight once for one row; the bound is the
weight's bytes over the memory bandwidth. cuBLAS reaches 1.4-2.5 TB/s on a Llama-1B
layer's 8-34 MB weights and splits the 8192-input down projection over two kernels (a
reduction after it); this kernel reads the weight in tiles of ``BLOCK_N`` output rows by
``BLOCK_K`` inputs, one program per tile row, keeps a (``BLOCK_N``, ``BLOCK_K``) float32
accumulator and sums it across the inputs once at the end.

On Hopper it launches with programmatic dependent launch (``_triton.pdl``): each program
reads its first weight tile, then waits for the kernel before it (the one that wrote
``x``), so a product's weight starts streaming while the previous kernel drains. It lets
the next kernel launch at its own start for small weights and after its loop for large
ones (``late_trigger``), whichever measured faster.

``benchmarks/gemv_gpu.py --shipped-only`` measured it on an H200 with each call reading
its weight from memory, not from L2 (``results/gemv_rows1_shipped_h200.json``: one graph
of 50 calls over 256 MB of weight copies, median of 20 replays), microseconds:

==========================  ======  ======  =======  ==================
product (in, out)           cuBLAS  no PDL  shipped  tile, next kernel
==========================  ======  ======  =======  ==================
1B query/key/value (3072)     6.51    5.26     3.97  8x1024, at start
1B output (2048, 2048)        6.12    4.31     3.50  8x1024, at start
1B gate/up (2048, 16384)     17.82   18.43    17.68  8x512, after loop
1B down (8192, 2048)         14.03   10.60     9.96  8x1024, after loop
1B head (2048, 128256)      124.30  116.46   115.48  8x512, after loop
8B query/key/value (6144)    16.38   14.35    13.47  8x512, after loop
8B output (4096, 4096)       13.35   10.82     9.75  8x512, after loop
8B gate/up (4096, 28672)     59.24   55.39    54.52  8x512, after loop
8B down (14336, 4096)        32.36   29.81    29.05  4x512, after loop
==========================  ======  ======  =======  ==================

Launching the next kernel at the start instead of after the loop measured 11.3 against
10.0 us for the 1B down product and 12.7 against 9.8 for the 8B output one, while the
1B query/key/value and output products gain from it (4.0 against 4.5, 3.5 against 3.9).

Without programmatic dependent launch (before Hopper, or ``MESHLAB_PDL=0``) the gate/up
products were not faster here, so callers keep cuBLAS for them there (``wins``). A
variant that applied the gate's SiLU inside the gate/up product (two tiles a program)
measured slower (19.8 and 57.0 us) than this product and the activation kernel after
it. So did the gate's activation applied to this product's input (the down product
reading the gate/up row): every program recomputes it for the whole row, and a step took
4.40 against 4.14 ms at 8B, 0.936 against 0.911 at 1B
(``results/inference_*_glu-{inside,apart}_h200.json``). With two rows cuBLAS wins at 8B, so
only single rows come here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import chained, gdc_launch_dependents, gdc_wait, pdl


@triton.jit
def _row_part(X, G, rk, kmask, sq, NORM: tl.constexpr):
    # x's inputs rk in float32, normalized by g (and its squares summed) with NORM
    x = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        sq += x * x
        x = x * tl.load(G + rk, mask=kmask, other=0.0).to(tl.float32)
    return x, sq


@triton.jit
def _gemv(X, W, B, R, G, Y, N, K, SW, eps, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
          NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, LATE: tl.constexpr):
    # y = W (x [* g * rstd(x)]) [+ b] [+ r]; with NORM every program reads all of x anyway,
    # so each sums its squares too, and rstd scales the program's dot products at the end.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rows = W + rn[:, None].to(tl.int64) * SW
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    # The first tile of the weight, which no kernel writes, is read before waiting for the
    # kernel that writes x (PDL: while that kernel drains).
    rk = tl.arange(0, BLOCK_K)
    kmask = rk < K
    wmask = nmask[:, None] & kmask[None, :]
    w = tl.load(rows + rk[None, :], mask=wmask, other=0.0)
    if PDL:
        if not LATE:        # the next kernel may be placed now, else after the loop
            gdc_launch_dependents()
        gdc_wait()
    x, sq = _row_part(X, G, rk, kmask, sq, NORM)
    acc += w.to(tl.float32) * x[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(rows + rk[None, :], mask=wmask, other=0.0)
        x, sq = _row_part(X, G, rk, kmask, sq, NORM)
        acc += w.to(tl.float32) * x[None, :]
    if PDL and LATE:
        gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if NORM:
        y = y * (1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps))
    if HAS_BIAS:
        y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(R + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=nmask)


# Products of at most this many outputs take the wide tile (8 rows by 1024 inputs, 8 warps)
# and the norm inside; wider ones the 512-input tile with the norm apart (module docstring).
_WIDE_TILE_MAX_N = 3072
# Weights of more elements than this let the next kernel launch after the loop, not at
# the start (module docstring).
_EARLY_MAX_ELEMENTS = 1 << 23


def wins(n: int, k: int, device: torch.device) -> bool:
    """Whether this kernel beat cuBLAS for a (``n`` out, ``k`` in) weight when measured:
    every decode product with programmatic dependent launch; without, all but the wide
    gated-MLP ones (module docstring)."""
    return pdl(device) or not (8192 < n < 65536)


def takes_norm(n: int, k: int) -> bool:
    """Whether the RMS norm of ``x`` measured faster inside the product than as its own
    kernel before it: for the 1B layer's query/key/value tile (GPU time per decode step
    1.030 to 0.990 ms with the residual add in the down product as well), not for the
    8B's (its products 1.99 to 2.12 ms a step: the extra loads of the norm weight slow the
    4-by-512 tiles more than the norm kernel costs)."""
    return n <= _WIDE_TILE_MAX_N


def late_trigger(n: int, k: int) -> bool:
    """Whether the next kernel should launch only after this one's loop: for weights of
    more than 8M elements (16 MB in bf16), where launching it at the start measured slower
    (module docstring)."""
    return n * k > _EARLY_MAX_ELEMENTS


def _tile(n: int, k: int) -> tuple[int, int, int]:
    """(rows, inputs, warps) of a program's tile: the ones measured fastest (module
    docstring)."""
    if n <= _WIDE_TILE_MAX_N:
        return 8, 1024, 8
    return (4 if k >= 8192 else 8), 512, 4


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
         r: torch.Tensor | None = None, g: torch.Tensor | None = None,
         eps: float = 0.0, *, late: bool | None = None) -> torch.Tensor:
    """``F.linear(x, w, b) + r`` for ``x`` (K,) contiguous, ``w`` (N, K) with unit column
    stride, bias ``b`` and residual ``r`` (N,) contiguous or ``None``, all of one dtype;
    with a norm weight ``g`` (K,), ``x`` is first RMS-normalized (``eps``) and scaled by
    ``g``, in float32, as one product; returns (N,).

    With programmatic dependent launch (``_triton.pdl``) the first tile of ``w`` is read
    before the kernels queued ahead of this one have finished: ``w`` must be a weight that
    none of them writes, as a decode step's are. ``late``: let the next kernel launch only
    after this one's loop (else at its start); ``None`` picks what measured faster."""
    n, k = w.shape
    bn, bk, warps = _tile(n, k)
    y = torch.empty(n, device=x.device, dtype=x.dtype)
    _gemv[(triton.cdiv(n, bn),)](x, w, y if b is None else b, y if r is None else r,
                                 y if g is None else g, y, n, k, w.stride(0), eps,
                                 HAS_BIAS=b is not None, HAS_RES=r is not None,
                                 NORM=g is not None, BLOCK_N=bn, BLOCK_K=bk,
                                 LATE=late_trigger(n, k) if late is None else late,
                                 num_warps=warps, num_stages=3, **chained(x.device))
    return y
