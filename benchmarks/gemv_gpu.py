"""Matrix-vector products of a decode step: cuBLAS (``F.linear``) against candidate Triton
kernels, at the shapes of a Llama-1B and a Llama-3-8B layer and head.

    python benchmarks/gemv_gpu.py [--rows 1] [--copy-to DIR]

At batch 1 a decode step is a chain of products of one row against a weight: the bytes
are the weight's, so the bound is its size over the memory bandwidth. In the 1B engine's
profile (``inference_gpu.py --profile 1``) the 8-12 MB query/key/value and output products
reach 1.5-2.2 TB/s and the down product 2.5 TB/s (split-K, a reduction kernel after it),
where the gate/up product reaches 3.6. The candidates here read the weight in tiles of
``BLOCK_N`` output rows by ``BLOCK_K`` inputs, one program per tile row and, for
``SPLIT`` > 1, a share of the inputs each, summed by atomic adds into a float32 buffer
(then cast: one more small kernel). For one row, the ``meshlab`` entry times the kernel
the engine ships (``meshlab/ops/_triton_gemv.py``, with the tile it picks for the shape),
with programmatic dependent launch where the device has it (each call's first weight tile
read while the call before drains) and, as ``meshlab_serial``, without; the candidates
here are the search space it was picked from (``--shipped-only`` skips them).

Timing: each product is captured ``CALLS`` times in one CUDA graph (a decode step replays
its kernels from a graph, so launch cost is not what is measured), replayed after a
warm-up, median of 20 replays by CUDA events. The calls cycle through copies of the
weight that together exceed the L2 cache (``RING_BYTES``), so each call reads its weight
from memory as a decode step does; one weight called 50 times would sit in the 50 MB L2
and flatter the small products. Outputs are checked against ``F.linear``
in float32 before timing. Writes ``results/gemv_rows<rows>[_shipped]_<card>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from ops_gpu import graphed  # noqa: E402

from meshlab.ops import _triton, _triton_gemv  # noqa: E402

CALLS = 50
RING_BYTES = 256e6            # about five times the H200's L2
# (name, in features K, out features N): Llama-3.2-1B and Llama-3-8B layers and heads
SHAPES = [("1b_qkv", 2048, 3072), ("1b_o", 2048, 2048), ("1b_gate_up", 2048, 16384),
          ("1b_down", 8192, 2048), ("1b_head", 2048, 128256),
          ("8b_qkv", 4096, 6144), ("8b_o", 4096, 4096), ("8b_gate_up", 4096, 28672),
          ("8b_down", 14336, 4096)]
# (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages, ACC2D): ACC2D keeps a (BLOCK_N, BLOCK_K)
# float32 accumulator and sums it once at the end (one row of x only)
CONFIGS = [(4, 512, 1, 4, 5, 1), (4, 1024, 1, 4, 3, 1), (8, 1024, 1, 8, 3, 1),
           (2, 1024, 1, 4, 3, 1), (4, 256, 1, 4, 6, 1), (8, 512, 1, 8, 4, 1),
           (8, 512, 1, 4, 3, 0), (16, 256, 1, 4, 4, 0), (16, 512, 1, 4, 3, 0),
           (32, 256, 1, 4, 3, 0), (8, 256, 2, 4, 3, 0), (16, 256, 2, 4, 3, 0),
           (16, 256, 4, 4, 3, 0), (32, 128, 4, 4, 4, 0), (4, 512, 1, 4, 3, 0),
           (4, 1024, 1, 4, 2, 0), (4, 512, 1, 2, 4, 0), (8, 1024, 1, 8, 2, 0),
           (8, 512, 1, 8, 3, 0), (2, 1024, 1, 2, 3, 0), (8, 512, 2, 4, 3, 0),
           (8, 512, 4, 4, 3, 0), (4, 512, 1, 4, 3, 1), (8, 512, 1, 4, 3, 1),
           (8, 256, 1, 4, 4, 1), (4, 256, 1, 2, 4, 1), (16, 256, 1, 8, 3, 1),
           (8, 512, 4, 4, 3, 1), (4, 1024, 1, 8, 2, 1)]


@triton.jit
def _gemv(X, W, Y, N, K, SX, SW, SY, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, ACC2D: tl.constexpr):
    # Y[m, n] (+)= sum_k X[m, k] * W[n, k] for the program's BLOCK_N outputs and its share
    # of K; ROWS (at most 4) rows of X, each its own float32 accumulator.
    pid = tl.program_id(0)
    share = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    per = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K
    lo = share * per
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(lo, tl.minimum(lo + per, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(W + rn[:, None].to(tl.int64) * SW + rk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
        if ACC2D:
            acc += w * x[None, :]
        else:
            acc0 += tl.sum(w * x[None, :], axis=1)
        if ROWS > 1:
            x = tl.load(X + SX + rk, mask=kmask, other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x[None, :], axis=1)
        if ROWS > 2:
            x = tl.load(X + 2 * SX + rk, mask=kmask, other=0.0).to(tl.float32)
            acc2 += tl.sum(w * x[None, :], axis=1)
        if ROWS > 3:
            x = tl.load(X + 3 * SX + rk, mask=kmask, other=0.0).to(tl.float32)
            acc3 += tl.sum(w * x[None, :], axis=1)
    if ACC2D:
        acc0 = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(Y + rn, acc0.to(Y.dtype.element_ty), mask=nmask)
        if ROWS > 1:
            tl.store(Y + SY + rn, acc1.to(Y.dtype.element_ty), mask=nmask)
        if ROWS > 2:
            tl.store(Y + 2 * SY + rn, acc2.to(Y.dtype.element_ty), mask=nmask)
        if ROWS > 3:
            tl.store(Y + 3 * SY + rn, acc3.to(Y.dtype.element_ty), mask=nmask)
    else:
        tl.atomic_add(Y + rn, acc0, mask=nmask)
        if ROWS > 1:
            tl.atomic_add(Y + SY + rn, acc1, mask=nmask)
        if ROWS > 2:
            tl.atomic_add(Y + 2 * SY + rn, acc2, mask=nmask)
        if ROWS > 3:
            tl.atomic_add(Y + 3 * SY + rn, acc3, mask=nmask)


def gemv(x: torch.Tensor, w: torch.Tensor, config) -> torch.Tensor:
    """``F.linear(x, w)`` for x (M <= 4, K) contiguous and w (N, K) contiguous."""
    bn, bk, split, warps, stages, acc2d = config
    if acc2d and x.shape[0] != 1:
        raise ValueError("ACC2D takes one row")
    m, k = x.shape
    n = w.shape[0]
    if split == 1:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        y = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    _gemv[(triton.cdiv(n, bn), split)](x, w, y, n, k, x.stride(0), w.stride(0), y.stride(0),
                                       ROWS=m, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, ACC2D=acc2d,
                                       num_warps=warps, num_stages=stages)
    return y if split == 1 else y.to(x.dtype)


def _graph_time(fn) -> float:
    """Microseconds per call: ``CALLS`` calls captured in one graph, median of 20 replays."""
    replay = graphed(lambda: [fn() for _ in range(CALLS)])
    for _ in range(3):
        replay()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1, help="rows of x (a decode batch), <= 4")
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--shipped-only", action="store_true",
                    help="time cuBLAS and the shipped kernel only, not the candidates")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    pdl = _triton.pdl(dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": datetime.date.today().isoformat(),
           "rows": args.rows, "method": f"{CALLS} calls in one CUDA graph cycling through "
           f"{RING_BYTES / 1e6:.0f} MB of weight copies (L2-cold), median of 20 replays; "
           f"bf16; checked against F.linear in float32", "shapes": {}}
    for name, k, n in SHAPES:
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        want = F.linear(x.float(), w.float())
        mb = w.numel() * w.element_size() / 1e6
        ring = [w] + [w.clone() for _ in range(int(RING_BYTES / (mb * 1e6)))]
        turn = iter(range(10 ** 9))

        def nxt():
            return ring[next(turn) % len(ring)]
        row = {"weight_MB": round(mb, 1)}
        us = _graph_time(lambda: F.linear(x, nxt()))
        row["cublas"] = {"us": round(us, 2), "TB/s": round(mb / us, 2)}
        if args.rows == 1:          # the kernel the engine ships, with the tile it picks
            err = (_triton_gemv.gemv(x[0], w).float() - want[0]).abs().max().item()
            assert err < 2e-2 * want.abs().max().item(), f"{name}: meshlab kernel off by {err}"
            # with programmatic dependent launch where the device has it (the next call
            # launched at this one's start or after its loop), and without
            for key, on, late in (("meshlab", pdl, None), ("meshlab_early", pdl, False),
                                  ("meshlab_late", pdl, True), ("meshlab_serial", False, None)):
                _triton._PDL[dev.index] = on
                us = _graph_time(lambda: _triton_gemv.gemv(x[0], nxt(), late=late))
                row[key] = {"us": round(us, 2), "TB/s": round(mb / us, 2), "pdl": on}
                if on and late is None:
                    row[key]["late"] = _triton_gemv.late_trigger(n, k)
            _triton._PDL[dev.index] = pdl
        for cfg in ([] if args.shipped_only else CONFIGS):
            key = "triton_n{}_k{}_split{}_w{}_s{}".format(*cfg[:5]) + ("_acc2d" if cfg[5] else "")
            if cfg[5] and args.rows != 1:
                continue
            try:
                err = (gemv(x, w, cfg).float() - want).abs().max().item()
                if not err < 2e-2 * want.abs().max().item():
                    row[key] = {"error": f"max difference {err:.3g}"}
                    continue
                us = _graph_time(lambda cfg=cfg: gemv(x, nxt(), cfg))
                row[key] = {"us": round(us, 2), "TB/s": round(mb / us, 2)}
            except Exception as e:       # a config that fails to compile is reported
                row[key] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        best = min((v["us"], k_) for k_, v in row.items() if isinstance(v, dict) and "us" in v)
        row["best"] = best[1]
        out["shapes"][name] = row
        ring.clear()
        print(name, row["cublas"], best, flush=True)
    name = f"gemv_rows{args.rows}" + ("_shipped" if args.shipped_only else "")
    print(_results.write(name, out["card"], out, args.copy_to))


if __name__ == "__main__":
    main()
