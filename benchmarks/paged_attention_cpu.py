"""Decode attention on this CPU: ``meshlab::paged_attention``'s C++ kernel (keys and values
read through the block tables) against the gathered-SDPA path it runs elsewhere (blocks
gathered, queries padded, one ``scaled_dot_product_attention``), on the same cache.

One decode step of ``--batch`` sequences (one new token each) of ``--context`` keys, a
Llama-like layer (32 query heads, 8 key/value heads of 128), blocks of 16 scattered over
the cache. Both paths are checked against each other first, then timed in interleaved
rounds after two warm-up calls; the median of ``--rounds`` is reported. Writes
``benchmarks/results/paged_attention_cpu_<tag>.json``, the tag defaulting to the host name.

    python benchmarks/paged_attention_cpu.py [--batch 8] [--context 1024] [--rounds 20]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from meshlab.ops import _build  # noqa: E402
from meshlab.ops.paged_attention import layout, paged_attention  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16


def case(batch: int, context: int, dtype):
    g = torch.Generator().manual_seed(0)
    per = -(-context // BLOCK)
    blocks = batch * per + 4
    kc = torch.randn(blocks, BLOCK, HKV, D, generator=g).to(dtype)
    vc = torch.randn(blocks, BLOCK, HKV, D, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[:batch * per].view(batch, per)
    q = torch.randn(batch, HQ, D, generator=g).to(dtype)
    lens, starts = [context] * batch, list(range(batch + 1))
    return q, kc, vc, tables, lens, starts


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--tag", default=socket.gethostname())
    args = p.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, tables, lens, starts = case(args.batch, args.context, dtype)
        where = layout(tables, lens, starts, BLOCK)

        def native():
            return paged_attention(q, kc, vc, tables, lens, starts, where=where)

        def gathered():
            with _build.force_reference():
                return paged_attention(q, kc, vc, tables, lens, starts, where=where)

        a = native()
        took = _build.LAST_PATH[("paged_attention", "cpu")]
        if not took.native:
            raise SystemExit(f"the C++ kernel did not run: {took.reason}")
        b = gathered()
        err = (a.float() - b.float()).abs().max().item()
        for fn in (native, gathered, native, gathered):          # warm-up
            fn()
        t_native, t_gathered = [], []
        for _ in range(args.rounds):                               # interleaved
            t_native += timed(native, 1)
            t_gathered += timed(gathered, 1)
        kv_bytes = 2 * args.batch * args.context * HKV * D * kc.element_size()
        n, s = statistics.median(t_native), statistics.median(t_gathered)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": args.batch,
                     "context": args.context, "max_abs_diff": err,
                     "native_ms": n * 1e3, "gathered_sdpa_ms": s * 1e3, "speedup": s / n,
                     "native_kv_GBps": kv_bytes / n / 1e9})
        print(f"{rows[-1]['dtype']:9s} C++ {n * 1e3:7.2f} ms ({kv_bytes / n / 1e9:5.1f} GB/s "
              f"of cache)  gathered SDPA {s * 1e3:7.2f} ms  {s / n:4.2f}x  "
              f"max |diff| {err:.2e}", flush=True)
    out = _results.cpu_run(
        "paged_attention_cpu",
        layer={"query_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BLOCK},
        timer="time.perf_counter, median of interleaved rounds after warm-up", results=rows)
    path = _results.write_cpu("paged_attention_cpu", args.tag, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
