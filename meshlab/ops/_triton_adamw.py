"""Triton kernel of :class:`meshlab.ops.FusedAdamW`: one launch updates a whole list of tensors.

Imported only when a ``FusedAdamW`` first steps a CUDA parameter, so a machine without
Triton never loads this file.

The launch covers every tensor of one (device, dtype, step) group through three tables,
built on the host (:func:`tensor_table`, :func:`chunk_table`) and copied to the device:

* ``TENSORS`` (int64, ``(n, 4)``): per tensor the addresses of the parameter, ``exp_avg``
  and ``exp_avg_sq`` and its element count. These do not move between steps, so the caller
  uploads the table once and keeps it on the device.
* ``GRADS`` (int64, ``(n,)``): per tensor the address of its gradient. A separate column,
  because a backward that starts from ``zero_grad(set_to_none=True)`` may allocate the
  gradients elsewhere: only this small array is uploaded again, and only when an address
  changed.
* ``CHUNKS`` (int32, ``(c, 2)``): per program the tensor index and the chunk index within
  the tensor; chunk ``j`` covers elements ``[j * CHUNK, (j + 1) * CHUNK)``.

A program reads its row of ``CHUNKS``, loads the four addresses and casts them to typed
pointers (``tl.load(...).to(tl.pointer_type(dtype))``, which the interpreter supports too),
then walks its chunk in ``BLOCK``-wide vectors: unmasked for the full blocks, masked once
for a tensor's tail. Each element is read
once (param, grad, exp_avg, exp_avg_sq) and written once (param, exp_avg, exp_avg_sq), with
the arithmetic in float32 whatever the storage dtype, in ``torch.optim.AdamW``'s order.

Pointers cast from integers carry no alignment for the compiler, which would then issue one
load per element. When every address of the launch is a multiple of 16 bytes (the caching
allocator hands out 512-byte aligned blocks: all but views at odd offsets qualify),
the ``ALIGNED`` specialization states so with ``tl.multiple_of``, and chunk and block offsets
are multiples of ``BLOCK``: the full blocks then load and store 16 bytes per thread access.

Why a pointer table rather than one flat buffer per group: a flat buffer needs the
parameters, gradients and state copied into it (or allocated in it from the start, which
ties the optimizer to how the model allocates its parameters and gradients). The table
updates tensors where they are; per step it costs at most the ``GRADS`` upload (8 bytes per
tensor), against 28 bytes per element (fp32) that the update itself must move.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

CHUNK = 65536          # elements per program: per-program work large enough to hide latency
BLOCK = 2048           # elements per vector step: 8 fp32 or bf16 values per thread at 8 warps
NUM_WARPS = 8

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
DTYPES = tuple(_TL_DTYPES)


@triton.jit
def _update(P, G, M, V, mask, decay, w1, beta2, w2, eps, bc2_sqrt, neg_step_size):
    # ``mask`` is None for a full block; lanes it masks off compute on whatever they loaded
    # and store nothing.
    p = tl.load(P, mask=mask).to(tl.float32)
    g = tl.load(G, mask=mask).to(tl.float32)
    m = tl.load(M, mask=mask).to(tl.float32)
    v = tl.load(V, mask=mask).to(tl.float32)
    p = p * decay                                              # param.mul_(1 - lr * wd)
    # exp_avg.lerp_(grad, w1), with lerp's two formulas (the one by the nearer end).
    d = g - m
    m = tl.where(w1 < 0.5, m + w1 * d, g - d * (1.0 - w1))
    v = v * beta2 + w2 * g * g                                 # mul_(beta2).addcmul_(g, g, w2)
    # IEEE-rounded sqrt and divisions, as torch's kernels use (Triton's defaults are faster
    # approximations, a few ulp off); the kernel is memory-bound, so they cost nothing here.
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + neg_step_size * tl.div_rn(m, denom)                # addcdiv_(m, denom, -step_size)
    tl.store(P, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V, v.to(V.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_chunks(TENSORS, GRADS, CHUNKS, decay, w1, beta2, w2, eps, bc2_sqrt, neg_step_size,
                  DTYPE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    t = tl.load(CHUNKS + 2 * c).to(tl.int64)
    j = tl.load(CHUNKS + 2 * c + 1).to(tl.int64)
    row = TENSORS + 4 * t
    p_addr = tl.load(row)
    m_addr = tl.load(row + 1)
    v_addr = tl.load(row + 2)
    n = tl.load(row + 3)
    g_addr = tl.load(GRADS + t)
    P = p_addr.to(tl.pointer_type(DTYPE))
    G = g_addr.to(tl.pointer_type(DTYPE))
    M = m_addr.to(tl.pointer_type(DTYPE))
    V = v_addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        P = tl.multiple_of(P, 16)
        G = tl.multiple_of(G, 16)
        M = tl.multiple_of(M, 16)
        V = tl.multiple_of(V, 16)
    start = j * CHUNK
    length = tl.minimum(n - start, CHUNK)
    full = length // BLOCK                 # blocks without a tail; one masked block may follow
    cols = tl.arange(0, BLOCK)
    # A fixed trip count with uniform branches rather than ``range(full)``: the same code on
    # the GPU, and it also runs under TRITON_INTERPRET=1, whose loops need host integers.
    for i in tl.range(0, CHUNK // BLOCK):
        offs = start + i * BLOCK + cols
        if i < full:
            _update(P + offs, G + offs, M + offs, V + offs, None, decay, w1, beta2, w2, eps,
                    bc2_sqrt, neg_step_size)
        elif i * BLOCK < length:
            _update(P + offs, G + offs, M + offs, V + offs, offs < n, decay, w1, beta2, w2,
                    eps, bc2_sqrt, neg_step_size)


def tensor_table(params, exp_avgs, exp_avg_sqs) -> torch.Tensor:
    """``(n, 4)`` int64 on the CPU: addresses of param, exp_avg, exp_avg_sq, and numel."""
    rows = [(p.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel())
            for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True)]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 4)


def chunk_table(numels: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """``(c, 2)`` int32 on the CPU: (tensor index, chunk index in the tensor) per program."""
    counts = torch.tensor([-(-n // chunk) for n in numels], dtype=torch.int64)
    total = int(counts.sum())
    if total >= 2**31:
        raise ValueError(f"FusedAdamW: {total} chunks of {chunk} elements exceed one launch's "
                         f"int32 chunk table; split the parameters over more param groups")
    index = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts                       # first chunk of each tensor
    within = torch.arange(total, dtype=torch.int64) - first[index]
    return torch.stack([index, within], 1).to(torch.int32)


def aligned(addresses) -> bool:
    """True when every address is a multiple of 16 bytes (the vectorized specialization)."""
    return not any(a & 15 for a in addresses)


def launch(tensors: torch.Tensor, grads: torch.Tensor, chunks: torch.Tensor, *,
           dtype: torch.dtype, aligned: bool, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, step: int) -> None:
    """One AdamW step over the tensors listed in the tables, all of ``dtype`` and at ``step``.

    The tables (see the module docstring) must be on the device of the tensors they point
    to; ``aligned`` says whether every address in ``tensors`` and ``grads`` is a multiple of
    16 bytes. The bias corrections are computed here from the Python ``step``.
    """
    n_chunks = chunks.shape[0]
    if n_chunks == 0:
        return
    bc1 = 1 - beta1 ** step
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    _adamw_chunks[(n_chunks,)](
        tensors, grads, chunks, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
        bc2_sqrt, -lr / bc1, DTYPE=_TL_DTYPES[dtype], ALIGNED=aligned, CHUNK=CHUNK,
        BLOCK=BLOCK, num_warps=NUM_WARPS)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, step: int) -> None:
    """One AdamW update in place over lists of contiguous tensors of one dtype and device.

    Builds the tables and launches once; :class:`~meshlab.ops.FusedAdamW` keeps the tables
    between steps instead. The tensors' device must be CUDA, or the CPU under
    ``TRITON_INTERPRET=1``.
    """
    if not params:
        return
    dtype, device = params[0].dtype, params[0].device
    if dtype not in _TL_DTYPES:
        raise TypeError(f"adamw_step: no Triton kernel for {dtype}; use float32, bfloat16 or "
                        f"float16 tensors")
    for group in (params, grads, exp_avgs, exp_avg_sqs):
        for x, p in zip(group, params, strict=True):
            if x.dtype != dtype or x.device != device or not x.is_contiguous() \
                    or x.numel() != p.numel():
                raise ValueError(f"adamw_step: every tensor must be contiguous, of one dtype "
                                 f"({dtype}) and device ({device}) and sized like its "
                                 f"parameter; got {x.dtype}, {x.device}, shape "
                                 f"{tuple(x.shape)}, contiguous={x.is_contiguous()}")
    tensors = tensor_table(params, exp_avgs, exp_avg_sqs)
    gptrs = [g.data_ptr() for g in grads]
    chunks = chunk_table([p.numel() for p in params])
    ok = aligned(gptrs) and aligned(tensors[:, :3].flatten().tolist())
    launch(tensors.to(device), torch.tensor(gptrs, dtype=torch.int64, device=device),
           chunks.to(device), dtype=dtype, aligned=ok, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, step=step)
