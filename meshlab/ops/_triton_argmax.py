"""Triton arg-max of a few rows of logits in one launch, for greedy decoding on CUDA.

A greedy decode step ends in the arg-max of each row's logits over a vocabulary of up to
hundreds of thousands. PyTorch's reduction runs one row as one thread block; split into
chunks it takes three kernels (the chunks' maxima, their arg-max, a gather). Here one
program per (row, chunk of ``BLOCK``) finds its chunk's maximum and first index, writes
them beside the others, and the last of a row's programs to finish (a counter per row,
``_triton.counters``) picks the first chunk holding the row's maximum: the first index
among equal maxima, as ``argmax`` gives. NaN logits give an unspecified index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import _after_previous, chained, counters

_BLOCK = 2048


@triton.jit
def _argmax(X, OUT, VAL, IDX, COUNT, V, SX, CHUNKS, BLOCK: tl.constexpr,
            BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * SX + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, offs, V), axis=0)    # its first index in the chunk
    tl.store(VAL + row * CHUNKS + c, best)
    tl.store(IDX + row * CHUNKS + c, first)
    tl.debug_barrier()          # the stores above before the release below
    counter = COUNT + row
    if tl.atomic_add(counter, 1, sem="acq_rel") == CHUNKS - 1:     # the row's last program
        tl.store(counter, 0)
        cs = tl.arange(0, BLOCK_C)
        vals = tl.load(VAL + row * CHUNKS + cs, mask=cs < CHUNKS, other=float("-inf"),
                       cache_modifier=".cg")
        idx = tl.load(IDX + row * CHUNKS + cs, mask=cs < CHUNKS, other=V,
                      cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        tl.store(OUT + row, tl.min(tl.where(vals == top, idx, V), axis=0).to(tl.int64))


def fits(logits: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes ``logits``: (S, V) with unit column stride and at most
    ``1024 * BLOCK`` columns (one load of the chunks' maxima)."""
    return logits.dim() == 2 and logits.stride(-1) == 1 and 0 < logits.shape[-1] <= 1024 * _BLOCK


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of (S, V) logits (:func:`fits`), int64 (S,), one launch."""
    s, v = logits.shape
    chunks = triton.cdiv(v, _BLOCK)
    out = torch.empty(s, dtype=torch.long, device=logits.device)
    if s == 0:
        return out
    val = torch.empty(s, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(s, chunks, dtype=torch.int32, device=logits.device)
    _argmax[(s, chunks)](logits, out, val, idx, counters(s, logits.device, "argmax"), v,
                         logits.stride(0), chunks, BLOCK=_BLOCK,
                         BLOCK_C=max(2, triton.next_power_of_2(chunks)), num_warps=8,
                         **chained(logits.device))
    return out
