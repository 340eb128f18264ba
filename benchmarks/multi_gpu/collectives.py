"""Bandwidth of all-reduce, reduce-scatter and all-gather through meshlab's path against
raw ``torch.distributed`` calls on the same buffers, 1 MiB to 1 GiB (powers of 4).

meshlab's path is DTensor ``redistribute`` of a tensor created with ``ml.distribute`` on
an ``ml.Mesh(dp=world)``:

* all-reduce:      Partial -> Replicate   (the local buffer of ``ml.distribute(x, mesh, P())``
                   declared a pending sum with ``DTensor.from_local(..., [Partial()])``, as a
                   gradient is; ``ml.distribute`` itself takes whole values only)
* reduce-scatter:  Partial -> Shard(0)    (the same buffer)
* all-gather:      Shard(0) -> Replicate  (``ml.distribute(x, mesh, P('dp'))``)

Raw: ``dist.all_reduce`` (in place on that buffer), ``dist.reduce_scatter_single`` /
``reduce_scatter_tensor`` from it, ``dist.all_gather_single`` / ``all_gather_into_tensor``
of the Shard's local buffer. Size is the whole (global) buffer, as in nccl-tests:
algbw = size / time, busbw = algbw * 2(n-1)/n for all-reduce and algbw * (n-1)/n for the
others. Each size is first checked (both paths give the exact sum / concatenation of
small-integer data), then timed: ``--warmup`` untimed calls, then ``--repeats`` blocks of
``iters`` calls, meshlab's and raw blocks alternating, CUDA events on GPU
(``time.perf_counter`` on the CPU); the median block gives the time per call. Sizes of
64 MiB and more whose meshlab/raw bus-bandwidth ratio is below 0.90 are flagged.

    torchrun --nproc-per-node 8 benchmarks/multi_gpu/collectives.py
    torchrun --nproc-per-node 2 benchmarks/multi_gpu/collectives.py --device cpu --quick
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.nvlink_multicast_off()

import torch  # noqa: E402

MiB = 1 << 20
FULL_SIZES = [MiB * 4 ** k for k in range(6)]               # 1 MiB .. 1 GiB
QUICK_SIZES = [16 << 10, 64 << 10, 256 << 10, MiB]          # 16 KiB .. 1 MiB
FLAG_FROM, FLAG_BELOW = 64 * MiB, 0.90
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def iters_for(size: int, quick: bool) -> int:
    if quick:
        return 3
    return 20 if size <= 16 * MiB else (10 if size <= 256 * MiB else 5)


def fmt(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size >> 10} KiB"


def make_ops(env, mesh, size: int, dtype):
    """{op: (meshlab fn, raw fn, check fn)} over shared buffers of ``size`` global bytes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import meshlab as ml

    dm = mesh.device_mesh
    n, r = env.world, env.rank
    numel = size // torch.tensor([], dtype=dtype).element_size()
    if numel % n:
        raise ValueError(f"{size} bytes do not split over {n} ranks")
    dev = env.device
    # all-reduce / reduce-scatter: one buffer, a pending sum on every rank
    whole = ml.distribute(torch.zeros(numel, dtype=dtype, device=dev), mesh, ml.P())
    buf = whole.to_local()
    partial = DTensor.from_local(buf, dm, [Partial()], run_check=False)
    rs_out = torch.empty(numel // n, dtype=dtype, device=dev)
    # all-gather: this rank's shard and the gathered result
    sharded = ml.distribute(torch.zeros(numel, dtype=dtype, device=dev), mesh, ml.P("dp"))
    shard = sharded.to_local()
    ag_out = torch.empty(numel, dtype=dtype, device=dev)
    rs_raw = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag_raw = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def fill():
        buf.fill_(r + 1)
        shard.copy_(torch.arange(numel // n, device=dev, dtype=torch.float32).remainder_(61)
                    .add_(100 * r).to(dtype))

    def check() -> dict:
        fill()
        total = n * (n + 1) / 2
        ok = {}
        got = partial.redistribute(dm, [Replicate()]).to_local()
        ok["all_reduce"] = bool((got == total).all())
        got = partial.redistribute(dm, [Shard(0)]).to_local()
        rs_raw(rs_out, buf)
        ok["reduce_scatter"] = bool((got == total).all()) and torch.equal(got, rs_out)
        got = sharded.redistribute(dm, [Replicate()]).to_local()
        ag_raw(ag_out, shard)
        expect = torch.cat([(torch.arange(numel // n, device=dev, dtype=torch.float32)
                             .remainder_(61) + 100 * k).to(dtype) for k in range(n)])
        ok["all_gather"] = torch.equal(got, expect) and torch.equal(ag_out, expect)
        t = buf.clone()
        dist.all_reduce(t)
        ok["all_reduce"] = ok["all_reduce"] and bool((t == total).all())
        buf.zero_()     # timing runs on zeros: repeated in-place sums stay finite
        return ok

    ops = {
        "all_reduce": (lambda: partial.redistribute(dm, [Replicate()]),
                       lambda: dist.all_reduce(buf)),
        "reduce_scatter": (lambda: partial.redistribute(dm, [Shard(0)]),
                           lambda: rs_raw(rs_out, buf)),
        "all_gather": (lambda: sharded.redistribute(dm, [Replicate()]),
                       lambda: ag_raw(ag_out, shard)),
    }
    return ops, check


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--sizes", default=None, help="comma-separated byte counts (override)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=None, help="timed blocks (default 9; quick 3)")
    args = p.parse_args()
    env = C.Env(args)
    dtype = getattr(torch, args.dtype)
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes else
             (QUICK_SIZES if args.quick else FULL_SIZES))
    repeats = args.repeats or (3 if args.quick else 9)
    warmup = 1 if args.quick and args.warmup == 5 else args.warmup
    mesh = env.mesh(dp=env.world)
    timer = C.Timer(env)
    n = env.world
    rows, flags = [], []
    t0 = time.perf_counter()
    for size in sizes:
        try:
            ops, check = make_ops(env, mesh, size, dtype)
            correct = check()
        except Exception as e:  # noqa: BLE001 - recorded
            err = C.describe_error(e)
            rows.append({"bytes": size, "status": err["status"], "raised_at": err["raised_at"]})
            if env.rank == 0:
                print(f"{fmt(size):>8s}  {err['status'][:200]}", flush=True)
            continue
        iters = iters_for(size, args.quick)
        for op in OPS:
            ml_fn, raw_fn = ops[op]
            t_ml, t_raw = [], []
            try:
                for fn in (ml_fn, raw_fn):
                    timer.run(fn, warmup=warmup, repeats=0)
                for _ in range(repeats):
                    t_ml += timer.run(ml_fn, warmup=0, repeats=1, iters=iters)
                    t_raw += timer.run(raw_fn, warmup=0, repeats=1, iters=iters)
            except Exception as e:  # noqa: BLE001 - recorded
                err = C.describe_error(e)
                rows.append({"op": op, "bytes": size, "status": err["status"],
                             "raised_at": err["raised_at"]})
                continue
            # the slowest rank decides the collective's time
            t_ml_all = env.gather(C.median(t_ml))
            t_raw_all = env.gather(C.median(t_raw))
            tm, tr = max(t_ml_all), max(t_raw_all)
            f = bus_factor(op, n)
            row = {"op": op, "bytes": size, "size": fmt(size), "dtype": args.dtype,
                   "iters_per_block": iters, "blocks": repeats, "correct": correct[op],
                   "meshlab_s": tm, "raw_s": tr,
                   "meshlab_algbw_GBps": size / tm / 1e9, "raw_algbw_GBps": size / tr / 1e9,
                   "meshlab_busbw_GBps": size / tm / 1e9 * f,
                   "raw_busbw_GBps": size / tr / 1e9 * f,
                   "ratio_meshlab_over_raw": tr / tm,
                   "meshlab_blocks_s_rank0": t_ml, "raw_blocks_s_rank0": t_raw}
            row["flag"] = size >= FLAG_FROM and row["ratio_meshlab_over_raw"] < FLAG_BELOW
            if row["flag"]:
                flags.append({"op": op, "size": fmt(size),
                              "ratio": round(row["ratio_meshlab_over_raw"], 3)})
            rows.append(row)
            if env.rank == 0:
                print(f"{op:15s} {fmt(size):>8s}  busbw meshlab {row['meshlab_busbw_GBps']:9.3f}"
                      f"  raw {row['raw_busbw_GBps']:9.3f} GB/s  ratio "
                      f"{row['ratio_meshlab_over_raw']:.3f}  correct {row['correct']}"
                      f"{'  FLAG' if row['flag'] else ''}", flush=True)
        del ops, check
        if env.cuda:
            torch.cuda.empty_cache()
    big = [r for r in rows if "ratio_meshlab_over_raw" in r and r["bytes"] >= FLAG_FROM]
    payload = {
        "conventions": {
            "size": "bytes of the whole (global) buffer, as nccl-tests",
            "algbw": "size / time per call (GB/s = 1e9 bytes/s)",
            "busbw": "all_reduce: algbw*2(n-1)/n; reduce_scatter, all_gather: algbw*(n-1)/n",
            "time": "median over blocks of the per-call time, the slowest rank's",
            "timer": "CUDA events" if env.cuda else "time.perf_counter (CPU dry run)",
            "meshlab_path": "DTensor.redistribute: Partial->Replicate, Partial->Shard(0), "
                            "Shard(0)->Replicate on ml.distribute tensors",
            "raw_path": "dist.all_reduce (in place), reduce_scatter_single / "
                        "reduce_scatter_tensor, all_gather_single / all_gather_into_tensor",
        },
        "target": {"ratio_at_least": FLAG_BELOW, "from_bytes": FLAG_FROM},
        "flagged": flags,
        "sizes_checked_for_target": len(big),
        "min_ratio_at_or_above_64MiB": min((r["ratio_meshlab_over_raw"] for r in big),
                                           default=None),
        "all_correct": all(r.get("correct", False) for r in rows),
        "seconds_total": round(time.perf_counter() - t0, 2),
        "results": rows,
    }
    C.write_json(env, "collectives", payload)
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
