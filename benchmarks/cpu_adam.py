"""Parameters per second of one AdamW step on this CPU: meshlab's CPUAdamW vs torch.optim.AdamW.

The three optimizers step the same float32 parameters (a Llama-like mix of matrices and
vectors, ``--params`` elements in all) with the same gradients; each is timed over
``--steps`` interleaved rounds after two warm-up steps; the median step time is reported. Before
timing, the updates of CPUAdamW and AdamW(foreach=True) are compared after three steps.
Writes ``benchmarks/results/cpu_adam_<tag>.json``, the tag defaulting to the host name.

    python benchmarks/cpu_adam.py [--params 50e6] [--steps 10] [--threads N] [--tag NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import cpu_model  # noqa: E402
from meshlab.ops import CPUAdamW  # noqa: E402


def make_params(total: int) -> list[torch.nn.Parameter]:
    # Matrices of a 4096-wide decoder layer plus norm vectors, repeated up to ``total``.
    shapes, n = [], 0
    while n < total:
        for s in [(1024, 4096), (1024, 1024), (4096,), (3584, 1024), (4096,)]:
            shapes.append(s)
            n += torch.Size(s).numel()
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


def clone(ps):
    out = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for q, p in zip(out, ps):
        q.grad = p.grad.clone()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default=socket.gethostname(),
                    help="file name tag (default: host name; set it where host names repeat)")
    ap.add_argument("--copy-to", default=None, help="also write the JSON into this folder")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)

    small = make_params(2_000_000)
    a, b = clone(small), clone(small)
    oa, ob = CPUAdamW(a, **kw), torch.optim.AdamW(b, foreach=True, **kw)
    for _ in range(3):
        oa.step(), ob.step()
    max_diff = max(float((x - y).detach().abs().max()) for x, y in zip(a, b))
    assert oa.native, f"CPUAdamW fell back: {oa.fallback_reason}"

    base = make_params(int(args.params))
    numel = sum(p.numel() for p in base)
    makers = {"meshlab_CPUAdamW": lambda ps: CPUAdamW(ps, **kw),
              "torch_AdamW_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kw),
              "torch_AdamW_fused": lambda ps: torch.optim.AdamW(ps, fused=True, **kw)}
    opts = {name: make(clone(base)) for name, make in makers.items()}
    for opt in opts.values():
        opt.step(), opt.step()                                  # warm-up: state allocation
    # Interleaved rounds, one step of each per round: on a shared machine, load that comes
    # and goes then hits all three alike instead of whichever ran at the time.
    times = {name: [] for name in opts}
    load_before = os.getloadavg()[0]
    for _ in range(args.steps):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    results = {}
    for name, ts in times.items():
        s = statistics.median(ts)
        results[name] = {"median_step_s": s, "min_step_s": min(ts), "params_per_s": numel / s}
        print(f"{name:22s} {s * 1e3:8.1f} ms/step (min {min(ts) * 1e3:.1f})  "
              f"{numel / s / 1e6:8.1f} M params/s")
    host = socket.gethostname()
    out = {"host": host, "cpu_model": cpu_model(), "threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "params": numel, "tensors": len(base), "steps_timed": args.steps,
           "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
           "max_abs_diff_vs_AdamW_after_3_steps": max_diff, "results": results}
    name = f"cpu_adam_{args.tag}.json"
    path = Path(__file__).resolve().parent / "results" / name
    path.write_text(json.dumps(out, indent=1))
    if args.copy_to:
        Path(args.copy_to, name).write_text(json.dumps(out, indent=1))
    print(f"wrote {path}; max |CPUAdamW - AdamW| after 3 steps: {max_diff:.2e}")


if __name__ == "__main__":
    main()
