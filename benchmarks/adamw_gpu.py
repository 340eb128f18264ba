"""Time of one AdamW step on one GPU: meshlab's FusedAdamW against torch.optim.AdamW with
``foreach=True`` and with ``fused=True``.

Two workloads, each in float32 and in bfloat16 (parameters, gradients and state of that
dtype, as torch's fused mode requires):

* ``llama``: the parameter list of a Llama-3-8B-shaped model cut to ``--layers`` decoder
  layers (q/o 4096x4096, k/v 1024x4096, gate/up/down 14336x4096, two 4096 norms each) plus
  the 128256x4096 embedding and LM head and the final norm.
* ``small``: ``--small-count`` tensors of ``--small-size`` elements, where the host's work
  per tensor, not memory bandwidth, sets the pace.

Each optimizer steps the same parameters with the same gradients (kept between steps, as
with ``zero_grad(set_to_none=False)``); its state is created by one step, then
``--warmup`` steps run untimed and ``--rep`` steps are timed one by one with CUDA events;
the median is reported, with the host's time to issue a step (median, no synchronization)
beside it. Optimizers run one after another, the previous one's state freed, so the llama
workload fits at 8 layers. Effective bandwidth counts the bytes a fused step must move:
numel * (4 reads + 3 writes) * itemsize. Before timing, FusedAdamW and AdamW(fused=True)
each take one step from the same parameters and gradients, and the largest difference of
the resulting parameters is reported.

Writes ``benchmarks/results/adamw_gpu_<card>.json``.

    python benchmarks/adamw_gpu.py [--layers 8] [--small-count 2000] [--small-size 4096]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402

from meshlab.ops import FusedAdamW  # noqa: E402

HIDDEN, KV, MLP, VOCAB = 4096, 1024, 14336, 128256
KW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def llama_shapes(layers: int) -> list[tuple[int, ...]]:
    per_layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
                 (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP), (HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN)] + per_layer * layers + [(HIDDEN,), (VOCAB, HIDDEN)]


def make(shapes, dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, device="cuda", generator=g) * 0.02).to(dtype))
        p.grad = (torch.randn(s, device="cuda", generator=g) * 1e-3).to(dtype)
        ps.append(p)
    return ps


def time_steps(opt, warmup: int, rep: int) -> tuple[float, float]:
    """(median GPU ms per step from CUDA events, median host ms to issue one step)."""
    for _ in range(warmup):
        opt.step()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    host = []
    for s, e in zip(starts, ends):
        s.record()
        t0 = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t0)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), \
        statistics.median(host) * 1e3


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def max_diff_one_step(ps) -> float:
    """One step of FusedAdamW and of AdamW(fused=True) from copies of ``ps``."""
    out = []
    for make_opt in (lambda q: FusedAdamW(q, **KW),
                     lambda q: torch.optim.AdamW(q, fused=True, **KW)):
        q = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        for x, p in zip(q, ps):
            x.grad = p.grad
        opt = make_opt(q)
        opt.step()
        if isinstance(opt, FusedAdamW) and not opt.native:
            raise SystemExit(f"FusedAdamW did not run its Triton kernel: {opt.fallback_reason}")
        out.append(q)
        del opt
        free()
    diff = max(float((x.detach().float() - y.detach().float()).abs().max())
               for x, y in zip(*out) if x.numel())
    del out
    free()
    return diff


def run(name: str, shapes, dtype_name: str, warmup: int, rep: int) -> dict:
    dtype = DTYPES[dtype_name]
    ps = make(shapes, dtype)
    numel = sum(p.numel() for p in ps)
    nbytes = numel * 7 * ps[0].element_size()
    row = {"workload": name, "dtype": dtype_name, "tensors": len(ps), "numel": numel,
           "bytes_per_step": nbytes, "max_abs_diff_vs_fused_after_1_step": max_diff_one_step(ps)}
    makers = {"torch_AdamW_foreach": lambda: torch.optim.AdamW(ps, foreach=True, **KW),
              "torch_AdamW_fused": lambda: torch.optim.AdamW(ps, fused=True, **KW),
              "meshlab_FusedAdamW": lambda: FusedAdamW(ps, **KW)}
    for key, make_opt in makers.items():
        opt = make_opt()
        opt.step()                                               # creates the state
        ms, host_ms = time_steps(opt, warmup, rep)
        if key == "meshlab_FusedAdamW" and not opt.native:
            raise SystemExit(f"FusedAdamW did not run its Triton kernel: {opt.fallback_reason}")
        row[key] = {"ms": ms, "host_ms": host_ms, "gparam_per_s": numel / ms / 1e6,
                    "effective_GB_per_s": nbytes / ms / 1e6}
        del opt
        free()
    row["ratio_meshlab_over_fused"] = (row["meshlab_FusedAdamW"]["ms"]
                                       / row["torch_AdamW_fused"]["ms"])
    print(f"{name:6s} {dtype_name} {len(ps):5d} tensors {numel / 1e9:6.3f} Gparam | " + " | ".join(
        f"{k.removeprefix('torch_AdamW_').removeprefix('meshlab_')} {row[k]['ms']:8.3f} ms "
        f"({row[k]['effective_GB_per_s']:6.0f} GB/s, host {row[k]['host_ms']:.3f} ms)"
        for k in makers) + f" | meshlab/fused {row['ratio_meshlab_over_fused']:.3f} | "
        f"max diff {row['max_abs_diff_vs_fused_after_1_step']:.2e}")
    del ps
    free()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--small-count", type=int, default=2000)
    ap.add_argument("--small-size", type=int, default=4096)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--copy-to", default=None, help="also write the JSON into this folder")
    args = ap.parse_args()
    import triton

    from meshlab.ops import _triton_adamw

    dev = torch.cuda.get_device_properties(0)
    workloads = {"llama": llama_shapes(args.layers),
                 "small": [(args.small_size,)] * args.small_count}
    rows = [run(name, shapes, dt, args.warmup, args.rep)
            for name, shapes in workloads.items() for dt in args.dtypes.split(",")]
    out = {"card": dev.name, "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": f"one optimizer.step(), parameters and gradients kept between steps; "
                     f"state created by one step, {args.warmup} warm-up steps, median of "
                     f"{args.rep} steps timed by CUDA events (host_ms: median time to issue "
                     f"a step); bytes = numel * 7 * itemsize; optimizers run one at a time",
           "config": {"layers": args.layers, "small_count": args.small_count,
                      "small_size": args.small_size, "hyper": {**KW, "betas": list(KW["betas"])},
                      "kernel": {"chunk": _triton_adamw.CHUNK, "block": _triton_adamw.BLOCK,
                                 "num_warps": _triton_adamw.NUM_WARPS}},
           "results": rows}
    path = _results.write("adamw_gpu", dev.name, out, args.copy_to)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
