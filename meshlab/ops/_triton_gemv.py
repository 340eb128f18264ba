"""Triton matrix-vector product for one-row decode steps on CUDA: ``F.linear(x, w, b)``
for ``x`` of one row.

At batch 1 a decode step's products read each weight once for one row; the bound is the
weight's bytes over the memory bandwidth. cuBLAS reaches 1.4-2.5 TB/s on a Llama-1B
layer's 8-34 MB weights and splits the 8192-input down projection over two kernels (a
reduction after it); this kernel reads the weight in tiles of ``BLOCK_N`` output rows by
``BLOCK_K`` inputs, one program per tile row, keeps a (``BLOCK_N``, ``BLOCK_K``) float32
accumulator and sums it across the inputs once at the end. ``benchmarks/gemv_gpu.py``
measured the configurations on an H200 with each call reading its weight from memory, not
from L2 (``results/gemv_rows1_h200.json``: one graph of 50 calls over 256 MB of weight
copies, median of 20 replays), microseconds:

==========================  ======  ===========  =====================
product (in, out)           cuBLAS  this kernel  tile (N, K, warps)
==========================  ======  ===========  =====================
1B query/key/value (3072)     6.46      5.32      8, 1024, 8
1B output (2048, 2048)        6.09      4.41      8, 1024, 8
1B down (8192, 2048)         13.61     10.77      8, 1024, 8
1B head (2048, 128256)      125.45    120.37      8, 512, 4
8B query/key/value (6144)    15.87     14.56      8, 512, 4
8B output (4096, 4096)       13.32     10.90      8, 512, 4
8B down (14336, 4096)        31.94     30.09      4, 512, 4
==========================  ======  ===========  =====================

The gate/up products (16384 and 28672 outputs) are not faster here (19.1 against 18.3
us at 1B), so callers keep cuBLAS for them (``wins``). With two rows cuBLAS wins at 8B,
so only single rows come here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv(X, W, B, R, G, Y, N, K, SW, eps, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
          NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y = W (x [* g * rstd(x)]) [+ b] [+ r]; with NORM every program reads all of x anyway,
    # so each sums its squares too, and rstd scales the program's dot products at the end.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(W + rn[:, None].to(tl.int64) * SW + rk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
        if NORM:
            sq += x * x
            x = x * tl.load(G + rk, mask=kmask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
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


def wins(n: int, k: int) -> bool:
    """Whether this kernel beat cuBLAS for a (``n`` out, ``k`` in) weight when measured:
    every decode product but the wide gated-MLP ones (module docstring)."""
    return not (8192 < n < 65536)


def takes_norm(n: int, k: int) -> bool:
    """Whether the RMS norm of ``x`` measured faster inside the product than as its own
    kernel before it: for the 1B layer's query/key/value tile (GPU time per decode step
    1.030 to 0.990 ms with the residual add in the down product as well), not for the
    8B's (its products 1.99 to 2.12 ms a step: the extra loads of the norm weight slow the
    4-by-512 tiles more than the norm kernel costs)."""
    return n <= _WIDE_TILE_MAX_N


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
         r: torch.Tensor | None = None, g: torch.Tensor | None = None,
         eps: float = 0.0) -> torch.Tensor:
    """``F.linear(x, w, b) + r`` for ``x`` (K,) contiguous, ``w`` (N, K) with unit column
    stride, bias ``b`` and residual ``r`` (N,) contiguous or ``None``, all of one dtype;
    with a norm weight ``g`` (K,), ``x`` is first RMS-normalized (``eps``) and scaled by
    ``g``, in float32, as one product; returns (N,)."""
    n, k = w.shape
    # the tiles measured fastest (module docstring)
    if n <= _WIDE_TILE_MAX_N:
        bn, bk, warps = 8, 1024, 8
    else:
        bn, bk, warps = (4 if k >= 8192 else 8), 512, 4
    y = torch.empty(n, device=x.device, dtype=x.dtype)
    _gemv[(triton.cdiv(n, bn),)](x, w, y if b is None else b, y if r is None else r,
                                 y if g is None else g, y, n, k, w.stride(0), eps,
                                 HAS_BIAS=b is not None, HAS_RES=r is not None,
                                 NORM=g is not None, BLOCK_N=bn, BLOCK_K=bk,
                                 num_warps=warps, num_stages=3)
    return y
