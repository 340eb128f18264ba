"""How fast this GPU reads its memory: the ceiling a batch-1 decode step, which reads every
weight once, can reach.

    python benchmarks/hbm_read_gpu.py

Reads a 4 GiB bf16 buffer (far past L2) three ways and reports GB/s of bytes read, each
the median of 20 calls after 3 warm-up calls, timed with CUDA events:

* ``torch_sum``: ``x.sum()``, PyTorch's reduction;
* ``triton_read``: a Triton kernel in which each program streams a contiguous stretch in
  tiles of ``BLOCK`` elements and writes one float (its sum, so nothing is optimized
  away), for a few tile sizes and warp counts;
* ``copy``: ``y.copy_(x)``, reported as (read + written bytes) / time, the copy ceiling.

The fastest read is the bound the inference benchmark's batch-1 step is compared with,
beside the card's nominal 4.8 TB/s. Writes ``results/hbm_read_<card>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _timing import cuda_times  # noqa: E402


@triton.jit
def _read(X, OUT, N, PER, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(pid * PER, tl.minimum(N, pid * PER + PER), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, axis=0))


def _median_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    return statistics.median(cuda_times(fn, n))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    n = int(args.gib * 2**30) // 2
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: dict[str, float] = {}
    rows["torch_sum"] = nbytes / _median_ms(lambda: x.sum()) / 1e6
    for block, warps, per_sm in ((4096, 8, 4), (8192, 8, 4), (8192, 16, 2), (16384, 16, 2),
                                 (4096, 4, 8)):
        programs = sms * per_sm
        per = triton.cdiv(triton.cdiv(n, programs), block) * block
        out = torch.empty(programs, device="cuda")
        ms = _median_ms(lambda: _read[(programs,)](x, out, n, per, BLOCK=block,
                                                   num_warps=warps))
        rows[f"triton_read_block{block}_warps{warps}_programs{programs}"] = nbytes / ms / 1e6
    y = torch.empty_like(x)
    rows["copy_read_plus_write"] = 2 * nbytes / _median_ms(lambda: y.copy_(x)) / 1e6
    best = max(v for k, v in rows.items() if not k.startswith("copy"))
    result = {"card": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "bytes": nbytes, "gb_per_s": {k: round(v, 1) for k, v in rows.items()},
              "best_read_gb_per_s": round(best, 1)}
    for k, v in rows.items():
        print(f"{k:50s} {v:8.1f} GB/s")
    print(_results.write("hbm_read", result["card"], result, args.copy_to))


if __name__ == "__main__":
    main()
