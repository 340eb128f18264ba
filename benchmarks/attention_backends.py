"""Causal attention forward+backward by SDPA backend at one shape, against meshlab's op.

    python benchmarks/attention_backends.py --batch 8 --seq 2048 --heads 32 --kv 4 --dim 64

Inputs as Hugging Face's attention hands them over, and the output's gradient as it hands
it back: (B, H, S, D) views of (B, S, H, D) memory; a backend that cannot run the shape is
reported with its error. Writes ``results/attention_backends_d<dim>_<card>.json`` (and
into ``--copy-to``). Each timing is the mean of 10 calls queued back to back, median of 20
after 5 warm-up calls.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402


def _time(fn, reps=20, warm=5, calls=10):
    """Median over ``reps`` of the mean time of ``calls`` back-to-back calls: the host
    queues ahead of the GPU, as in a training step, so its launch cost is not counted."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("batch", 8), ("seq", 2048), ("heads", 32), ("kv", 4), ("dim", 64)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    from meshlab.ops.attention import attention

    b, s, h, kv, d = args.batch, args.seq, args.heads, args.kv, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(n):
        return torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16,
                           generator=g).transpose(1, 2).requires_grad_()

    q, k, v = make(h), make(kv), make(kv)
    # The output's gradient as Hugging Face hands it back: the transpose of (B, S, H, D).
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                       generator=g).transpose(1, 2)
    flops = 4 * b * h * s * s * d / 2 * 3.5           # causal: half; fwd + bwd = 3.5 fwd
    rows = {}

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), dout)
        return run

    def ours():
        torch.autograd.grad(attention(q, k, v, causal=True), (q, k, v), dout)

    cases = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION),
             "efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION), "meshlab": ours}
    for name, fn in cases.items():
        try:
            ms = _time(fn)
            rows[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as e:           # a backend that refuses the shape is reported
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(name, rows[name], flush=True)
    out = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.date.today().isoformat(),
           "method": "fwd + bwd; CUDA events around 10 calls queued back to back, "
                     "median of 20 after 5 warm-up calls",
           "shape": dict(batch=b, seq=s, heads=h, kv_heads=kv, head_dim=d), "rows": rows}
    print(_results.write(f"attention_backends_d{d}", out["card"], out, args.copy_to))


if __name__ == "__main__":
    main()
