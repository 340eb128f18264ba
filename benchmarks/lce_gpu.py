"""Peak memory and time of a linear head + cross-entropy, forward and backward, on one GPU.

meshlab's chunked ``linear_cross_entropy`` (the (N, V) logits never exist) against the
unfused ``F.cross_entropy((hidden @ weight.T).float(), target)``, at Llama-3-8B's head
(H 4096, V 128256), bf16. Peak memory is ``torch.cuda.max_memory_allocated`` during one
forward+backward minus what was allocated before it (inputs); time is the median of
``triton.testing.do_bench``. Both results are also checked against each other.
Writes ``benchmarks/results/lce_gpu_<card>.json``.

    python benchmarks/lce_gpu.py [--tokens 8192,16384] [--chunk 4096]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshlab.ops import linear_cross_entropy  # noqa: E402

HIDDEN, VOCAB = 4096, 128256


def eager(h, w, t):
    return F.cross_entropy((h @ w.T).float(), t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--chunk", type=int, default=4096)
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
        row = {"tokens": n, "hidden": HIDDEN, "vocab": VOCAB, "chunk": args.chunk,
               "logits_bytes_bf16": n * VOCAB * 2}
        fns = {"meshlab": lambda: linear_cross_entropy(h, w, t, chunk=args.chunk),
               "eager": lambda: eager(h, w, t)}
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
        a, b = outs["meshlab"], outs["eager"]
        row["loss"] = {"meshlab": float(a[0]), "eager": float(b[0])}
        row["grad_rel_diff"] = [float((x.double() - y.double()).norm() / y.double().norm())
                                for x, y in zip(a[1:], b[1:])]
        rows.append(row)
        print(f"N={n}: meshlab {row['meshlab']['ms']:.2f} ms, {row['meshlab']['peak_extra_GiB']:.2f} "
              f"GiB | eager {row['eager']['ms']:.2f} ms, {row['eager']['peak_extra_GiB']:.2f} GiB | "
              f"loss {row['loss']} | grad rel diff {row['grad_rel_diff']}")
        del h, w, t, outs, a, b
        torch.cuda.empty_cache()
    out = {"card": dev.name, "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": "forward+backward (grads of hidden and weight), bf16; peak = "
           "max_memory_allocated during one step minus allocated before it; do_bench median",
           "results": rows}
    name = "lce_gpu_" + ("h200" if "H200" in dev.name else dev.name.replace(" ", "_").lower())
    path = Path(__file__).resolve().parent / "results" / f"{name}.json"
    path.write_text(json.dumps(out, indent=1))
    if args.copy_to:
        Path(args.copy_to, f"{name}.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
