"""Host time per call of meshlab's ops, split into its parts, on tensors small enough that
the GPU is never the bottleneck (so what is timed is Python, dispatch and launch).

For RMSNorm forward+backward: the public op (custom op + autograd + Triton), the bare
Triton launches it makes, PyTorch's fused ``F.rms_norm``, and an empty custom op (the
dispatcher's own cost). Wall time of ``--calls`` calls after warm-up, divided by calls;
a synchronize at each end only. A cProfile of the public op's calls goes to
``--profile`` when given. Writes ``benchmarks/results/host_overhead_<card>.json``.

    python benchmarks/host_overhead.py [--calls 2000] [--profile prof.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import platform
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402

from meshlab.ops import rms_norm  # noqa: E402


@torch.library.custom_op("meshlab_bench::noop", mutates_args=())
def _noop(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@_noop.register_fake
def _(x):
    return x.new_empty(0)


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    import triton

    from meshlab.ops import _triton

    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", requires_grad=True)
    gy = torch.randn_like(x)
    xd, wf = x.detach(), w.detach().float()
    y0, rstd = _triton.rms_norm_fwd(xd, wf, 1e-6)

    def public():
        y = rms_norm(x, w)
        torch.autograd.grad(y, (x, w), gy)

    def native():
        y = F.rms_norm(x, (4096,), w.to(x.dtype), 1e-6)
        torch.autograd.grad(y, (x, w), gy)

    def bare():
        _triton.rms_norm_fwd(xd, wf, 1e-6)
        _triton.rms_norm_bwd(gy, xd, wf, rstd)

    def noop():
        torch.ops.meshlab_bench.noop(xd)

    def tiny_torch_op():
        torch.add(xd, 1)

    res = {k: per_call_us(f, args.calls) for k, f in
           (("public_fwd_bwd", public), ("torch_rms_norm_fwd_bwd", native),
            ("bare_triton_fwd_bwd", bare), ("empty_custom_op", noop),
            ("one_torch_add", tiny_torch_op))}
    for k, v in res.items():
        print(f"{k:>24}: {v:8.1f} us/call")
    prof_text = None
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(500):
            public()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        prof_text = s.getvalue()
        Path(args.profile).write_text(prof_text)
    dev = torch.cuda.get_device_properties(0)
    out = {"card": dev.name, "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "host": platform.processor() or platform.machine(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": f"wall time of {args.calls} calls after 50 warm-up calls, / calls; x (8, 4096) "
                     "bf16, so the GPU is idle most of the time and host time is what is timed",
           "us_per_call": res}
    path = _results.write("host_overhead", dev.name, out, args.copy_to)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
