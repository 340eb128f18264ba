"""Forward+backward time of causal grouped-query attention on one GPU: meshlab vs torch SDPA.

Llama-3-8B's attention (32 query heads on 8 kv heads of 128), bf16, causal, for batch
1..4 and 2048 / 8192 tokens. Variants, each one forward plus ``torch.autograd.grad`` of
q, k, v, timed with ``triton.testing.do_bench`` (median; warmup 25, rep 200):

* ``meshlab``        -- ``meshlab.ops.attention`` (flash-attn where installed, else the
  ``meshlab::attention`` custom op on cuDNN); the path it took is recorded per row;
* ``meshlab_op``     -- the custom op itself, when ``meshlab`` went to flash-attn;
* ``sdpa_cudnn``     -- ``F.scaled_dot_product_attention(..., enable_gqa=True)`` under
  ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``;
* ``sdpa_flash``     -- the same under ``SDPBackend.FLASH_ATTENTION``.

TFLOP/s count causal attention as half the full matrix products: forward
``2 * 2 * B * Hq * S * S * D / 2``, forward+backward 2.5 times that. Each variant's output
and gradients are compared with cuDNN's (max abs diff), and, where the float32 score
matrix fits in 4 GiB, with the float32 reference (relative norm error). A variant that
cannot run (no such backend for the shape) is reported with its error, not timed.
Writes ``benchmarks/results/attention_gpu_<card>.json``.

    python benchmarks/attention_gpu.py [--batch 1,2,3,4] [--seq 2048,8192] [--copy-to DIR]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402

from meshlab.ops import _build, attention, attention_reference  # noqa: E402

HQ, HKV, D = 32, 8, 128
REF_LIMIT_BYTES = 4 * 2**30


def _sdpa(backend):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return fn


def _op(q, k, v):
    return torch.ops.meshlab.attention(q, k, v, True, q.shape[-1] ** -0.5)[0]


def _step(fn, q, k, v, gout):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), gout))


def attention_reference_causal(q, k, v):
    return attention_reference(q, k, v, causal=True)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,2,3,4")
    ap.add_argument("--seq", default="2048,8192")
    ap.add_argument("--copy-to", default=None, help="also write the JSON into this folder")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    fa = sys.modules["meshlab.ops.attention"]._flash_attn()
    dev = torch.cuda.get_device_properties(0)
    rows = []
    for s in map(int, args.seq.split(",")):
        for b in map(int, args.batch.split(",")):
            torch.manual_seed(0)
            q = torch.randn(b, HQ, s, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(b, HKV, s, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(b, HKV, s, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            gout = torch.randn(b, HQ, s, D, device="cuda", dtype=torch.bfloat16)
            fwd_flops = 2 * 2 * b * HQ * s * s * D / 2
            row = {"batch": b, "seq": s, "heads_q": HQ, "heads_kv": HKV, "head_dim": D,
                   "dtype": "bfloat16", "causal": True, "fwd_flops": fwd_flops}
            fns = {"meshlab": lambda q, k, v: attention(q, k, v, causal=True)}
            attention(q, k, v, causal=True)
            row["meshlab_path"] = _build.LAST_PATH[("attention", "cuda")].reason
            if row["meshlab_path"].startswith("flash-attn"):
                fns["meshlab_op"] = _op
            fns["sdpa_cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
            fns["sdpa_flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
            outs = {}
            for name, fn in fns.items():
                try:
                    outs[name] = [t.detach() for t in _step(fn, q, k, v, gout)]
                except RuntimeError as e:  # no kernel of this backend for the shape
                    row[name] = {"error": str(e).strip().splitlines()[0][:300]}
                    continue
                with torch.no_grad():
                    fwd_ms = do_bench(lambda fn=fn: fn(q, k, v), warmup=25, rep=200,
                                      return_mode="median")
                ms = do_bench(lambda fn=fn: _step(fn, q, k, v, gout), warmup=25, rep=200,
                              return_mode="median")
                row[name] = {"ms": ms, "tflops": 2.5 * fwd_flops / (ms * 1e-3) / 1e12,
                             "fwd_ms": fwd_ms, "fwd_tflops": fwd_flops / (fwd_ms * 1e-3) / 1e12}
            if "meshlab_op" in fns:
                row["meshlab_op_path"] = _build.LAST_PATH[("attention", "cuda")].reason
            base = outs.get("sdpa_cudnn")
            if base is not None:
                for name, got in outs.items():
                    if name != "sdpa_cudnn":
                        row[name]["max_abs_diff_vs_cudnn"] = {
                            t: float((a.float() - e.float()).abs().max())
                            for t, a, e in zip(("out", "dq", "dk", "dv"), got, base)}
                if "ms" in row.get("meshlab", {}) and "ms" in row["sdpa_cudnn"]:
                    row["ratio_meshlab_over_cudnn"] = row["meshlab"]["ms"] / row["sdpa_cudnn"]["ms"]
            if b * HQ * s * s * 4 <= REF_LIMIT_BYTES:
                want = [t.detach() for t in _step(attention_reference_causal, q, k, v, gout)]
                for name, got in outs.items():
                    row[name]["rel_err_vs_fp32_reference"] = {
                        t: _rel(a, e) for t, a, e in zip(("out", "dq", "dk", "dv"), got, want)}
                del want
            rows.append(row)
            summary = " | ".join(f"{n} {row[n]['ms']:.2f} ms ({row[n]['tflops']:.0f} TF/s)"
                                 if "ms" in row[n] else f"{n} error" for n in fns)
            print(f"B={b} S={s}: {summary} | meshlab/cuDNN "
                  f"{row.get('ratio_meshlab_over_cudnn', float('nan')):.3f} | "
                  f"path {row['meshlab_path']}", flush=True)
            del q, k, v, gout, outs, base
            torch.cuda.empty_cache()
    out = {"card": dev.name, "torch": torch.__version__, "triton": triton.__version__,
           "cudnn": torch.backends.cudnn.version(),
           "flash_attn": None if fa is None else fa.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "method": "one forward + torch.autograd.grad of q, k, v (bf16, causal, GQA "
           f"{HQ}/{HKV} heads of {D}); do_bench median, warmup 25, rep 200; causal flops "
           "2*2*B*Hq*S*S*D/2 forward, x2.5 forward+backward; diffs against SDPA on cuDNN and "
           "the float32 reference",
           "results": rows}
    path = _results.write("attention_gpu", dev.name, out, args.copy_to)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
