"""Forward+backward time of each fused op on one GPU: meshlab (Triton) vs eager vs compiled.

For every op and size it first checks meshlab's output and gradients against a float64
evaluation of the reference (fresh random inputs, outputs poisoned beforehand), then times
one forward plus one backward (``torch.autograd.grad``, so no gradient accumulation) with
``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, median). Variants:

* ``meshlab``  -- ``meshlab.ops.<op>`` (the Triton kernels);
* ``eager``    -- the pure-PyTorch reference, unfused (float32 math like meshlab's);
* ``native``   -- PyTorch's own op where one exists (``F.rms_norm``, ``F.layer_norm``, and
  ``F.silu(a) * b`` in the input dtype);
* ``compiled`` -- ``torch.compile`` of the reference;
* ``meshlab_graph``, ``native_graph`` -- the same step captured in a CUDA graph and
  replayed: GPU time alone, without the host's per-launch overhead. ``host_us_per_call``
  is the host's time to issue one step, measured separately.

Effective bandwidth counts the fewest bytes a fused forward+backward must move (each
activation input read once and output written once per pass; weights and per-row
statistics ignored as <0.1%), over the median time, next to a device-to-device copy
measured in the same run. Writes ``benchmarks/results/ops_gpu_<card>.json``.

    python benchmarks/ops_gpu.py [--tokens 8192,32768] [--ops rms_norm,swiglu] [--no-compile]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402

import meshlab.ops as mops  # noqa: E402
from meshlab.ops import _build  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, MLP = 4096, 32, 128, 14336   # Llama-3-8B


def copy_bandwidth(do_bench) -> float:
    n = 1 << 30                                           # 1 GiB each way
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (ms * 1e-3)


def make(op: str, tokens: int, dtype):
    """(inputs needing grad, extra args, fused-pass bytes, callables by variant)."""
    def r(*s, dt=dtype):
        return torch.randn(*s, device="cuda", dtype=dt)
    e = torch.tensor([], dtype=dtype).element_size()
    if op == "rms_norm":
        x, w = r(tokens, HIDDEN), r(HIDDEN)
        f = {"meshlab": mops.rms_norm, "eager": mops.rms_norm_reference,
             "native": lambda x, w: F.rms_norm(x, (HIDDEN,), w, 1e-6)}
        return [x, w], (), 5 * tokens * HIDDEN * e, f
    if op == "layer_norm":
        x, w, b = r(tokens, HIDDEN), r(HIDDEN), r(HIDDEN)
        f = {"meshlab": mops.layer_norm, "eager": mops.layer_norm_reference,
             "native": lambda x, w, b: F.layer_norm(x, (HIDDEN,), w, b, 1e-5)}
        return [x, w, b], (), 5 * tokens * HIDDEN * e, f
    if op == "swiglu":
        a, b = r(tokens, MLP), r(tokens, MLP)
        f = {"meshlab": mops.swiglu, "eager": mops.swiglu_reference,
             "native": lambda a, b: F.silu(a) * b}
        return [a, b], (), 8 * tokens * MLP * e, f       # fwd 2r+1w, bwd 3r+2w
    if op == "rotary":
        x = r(1, tokens, HEADS, HEAD_DIM)
        ang = torch.outer(torch.arange(tokens, device="cuda", dtype=torch.float32),
                          torch.rand(HEAD_DIM // 2, device="cuda"))
        f = {"meshlab": mops.rotary, "eager": mops.rotary_reference}
        return [x], (ang.cos(), ang.sin()), 4 * tokens * HIDDEN * e, f
    raise KeyError(op)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def graphed(step):
    """``step`` captured in a CUDA graph: its replay times the GPU work without the host's
    launch overhead (Python, dispatcher, Triton's launcher)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def host_us(step, n: int = 50) -> float:
    """Host time per call when the GPU is not the bottleneck's cause: n calls, one sync."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def check(op: str, dtype) -> float:
    """Largest relative error of meshlab's output and grads against float64 reference."""
    ins, extra, _, f = make(op, 4096, dtype)
    ins = [t.requires_grad_() for t in ins]
    out = f["meshlab"](*ins, *extra)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, ins, g)
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    want = f["eager"](*ins64, *(t.double() for t in extra))
    want_g = torch.autograd.grad(want, ins64, g.double())
    path = _build.LAST_PATH[(op, "cuda")]
    assert path.native, f"{op} did not take the Triton path: {path.reason}"
    return max([rel(out, want)] + [rel(a, b) for a, b in zip(got, want_g)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--ops", default="rms_norm,rotary,swiglu,layer_norm")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--copy-to", default=None, help="also write the JSON into this folder")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    copy_bps = copy_bandwidth(do_bench)
    print(f"{dev.name}: device-to-device copy {copy_bps / 1e12:.2f} TB/s (read+write)")
    results = []

    def dump():
        # Written after every row, so a run cut short still leaves what it measured.
        out = {"card": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
               "triton": triton.__version__, "host": platform.node(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "copy_TBps": copy_bps / 1e12, "method": "forward+backward, triton.testing.do_bench "
               "median (warmup 25 ms, rep 200 ms, L2 flushed), bf16, min bytes of the fused passes",
               "results": results}
        path = _results.write("ops_gpu", dev.name, out, args.copy_to)
        return path

    for op in args.ops.split(","):
        errs = {str(dt): check(op, dt) for dt in (torch.float32, torch.bfloat16)}
        print(f"{op}: rel. error vs float64 reference {errs}")
        for tokens in map(int, args.tokens.split(",")):
            ins, extra, nbytes, f = make(op, tokens, torch.bfloat16)
            ins = [t.requires_grad_() for t in ins]
            if not args.no_compile:
                f["compiled"] = torch.compile(f["eager"], dynamic=False)
            row = {"op": op, "tokens": tokens, "dtype": "bfloat16", "min_bytes": nbytes,
                   "rel_error_vs_fp64": errs}
            g = torch.randn_like(f["meshlab"](*ins, *extra))
            for name, fn in f.items():
                def step(fn=fn):
                    return torch.autograd.grad(fn(*ins, *extra), ins, g)
                step()                                   # compile / autotune outside timing
                ms = do_bench(step, warmup=25, rep=200, return_mode="median")
                row[name] = {"ms": ms, "TBps": nbytes / (ms * 1e-3) / 1e12,
                             "of_copy_bw": nbytes / (ms * 1e-3) / copy_bps,
                             "host_us_per_call": host_us(step)}
                if name in ("meshlab", "native"):
                    gms = do_bench(graphed(step), warmup=25, rep=200, return_mode="median")
                    row[name + "_graph"] = {"ms": gms, "TBps": nbytes / (gms * 1e-3) / 1e12,
                                            "of_copy_bw": nbytes / (gms * 1e-3) / copy_bps}
            results.append(row)
            path = dump()
            print(f"{op:10s} T={tokens:6d} " + "  ".join(
                f"{k} {row[k]['ms']:.3f} ms ({row[k]['TBps']:.2f} TB/s)" for k in row
                if isinstance(row[k], dict) and "ms" in row[k]))
            print(" " * 19 + "host us/call: " + "  ".join(
                f"{k} {row[k]['host_us_per_call']:.0f}" for k in f))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
