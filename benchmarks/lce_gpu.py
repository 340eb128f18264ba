"""Peak memory and time of a linear head + cross-entropy, forward and backward, on one GPU.

meshlab's chunked ``linear_cross_entropy`` (the (N, V) logits never exist) against the
unfused ``F.cross_entropy((hidden @ weight.T).float(), target)`` (eager, and through
``torch.compile``), at Llama-3-8B's head
(H 4096, V 128256), bf16. Peak memory is ``torch.cuda.max_memory_allocated`` during one
forward+backward minus what was allocated before it (inputs); time is the median of
``triton.testing.do_bench``. Both results are also checked against each other.
Writes ``benchmarks/results/lce_gpu_<card>.json``.

    python benchmarks/lce_gpu.py [--tokens 8192,16384] [--chunk N]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402

from meshlab.ops.linear_cross_entropy import default_chunk, linear_cross_entropy  # noqa: E402

HIDDEN, VOCAB = 4096, 128256


def eager(h, w, t):
    return F.cross_entropy((h @ w.T).float(), t)


compiled = torch.compile(eager, dynamic=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the op's)")
    ap.add_argument("--copy-to", default=None, help="also write the JSON into this folder")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    rows = []
    for n in map(int, args.tokens.split(",")):
        h = (torch.randn(n, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(VOCAB, HIDDEN, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, VOCAB, (n,), device="cuda")
        row = {"tokens": n, "hidden": HIDDEN, "vocab": VOCAB,
               "chunk": args.chunk or default_chunk(VOCAB),
               "logits_bytes_bf16": n * VOCAB * 2}
        fns = {"meshlab": lambda: linear_cross_entropy(h, w, t, chunk=args.chunk),
               "eager": lambda: eager(h, w, t),
               "compiled": lambda: compiled(h, w, t)}
        outs = {}
        for name, fn in fns.items():
            def step(fn=fn):
                loss = fn()
                return (loss, *torch.autograd.grad(loss, (h, w)))
            outs[name] = step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            r = step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            del r
            ms = do_bench(step, warmup=25, rep=300, return_mode="median")
            row[name] = {"ms": ms, "peak_extra_GiB": peak / 2**30,
                         "tflops": 6 * n * HIDDEN * VOCAB / (ms * 1e-3) / 1e12}
        for name in ("meshlab", "compiled"):
            row[name]["peak_vs_eager"] = row["eager"]["peak_extra_GiB"] / row[name]["peak_extra_GiB"]
            row[name]["speed_vs_eager"] = row["eager"]["ms"] / row[name]["ms"]
        a, b = outs["meshlab"], outs["eager"]
        row["loss"] = {"meshlab": float(a[0]), "eager": float(b[0])}
        row["grad_rel_diff"] = [float((x.double() - y.double()).norm() / y.double().norm())
                                for x, y in zip(a[1:], b[1:])]
        # Both against float32 math on the same bf16 inputs: how far each is from exact.
        hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        ref = F.cross_entropy(hf @ wf.T, t)
        ref = (ref, *torch.autograd.grad(ref, (hf, wf)))
        row["rel_err_vs_fp32"] = {
            k: [float((x.float() - y).norm() / y.norm()) for x, y in zip(v, ref)]
            for k, v in (("meshlab", a), ("eager", b))}
        del hf, wf, ref
        rows.append(row)
        print(f"N={n}: " + " | ".join(f"{k} {row[k]['ms']:.2f} ms {row[k]['peak_extra_GiB']:.2f} GiB"
                                      for k in fns) + " | "
              f"loss {row['loss']} | rel err vs fp32 [loss, dh, dw] {row['rel_err_vs_fp32']}")
        del h, w, t, outs, a, b
        torch.cuda.empty_cache()
    out = {"card": dev.name, "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": "forward+backward (grads of hidden and weight), bf16; peak = "
           "max_memory_allocated during one step minus allocated before it; do_bench median",
           "results": rows}
    path = _results.write("lce_gpu", dev.name, out, args.copy_to)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
