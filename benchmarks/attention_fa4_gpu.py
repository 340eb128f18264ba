"""FlashAttention-4 (CuTe-DSL) against cuDNN and FlashAttention-2 through torch's SDPA, causal
grouped-query attention, bf16, forward and forward+backward, at head dims 64 and 128.

Shapes: TinyLlama-1.1B's attention (32 query heads on 4 kv heads of 64) and Llama-3-8B's
(32 on 8 of 128), each at 8 x 2048 and 2 x 8192 tokens. Variants, each timed on the
layout it takes (the transposes between them are not counted):

* ``sdpa_cudnn`` -- ``F.scaled_dot_product_attention(..., enable_gqa=True)`` on (B, H, S, D)
  under ``SDPBackend.CUDNN_ATTENTION`` (what ``meshlab::attention`` runs on CUDA today);
* ``sdpa_flash`` -- the same under ``SDPBackend.FLASH_ATTENTION`` (FlashAttention-2);
* ``fa4``        -- ``flash_attn.cute.flash_attn_func(q, k, v, causal=True)`` on (B, S, H, D),
  where ``flash-attn-4`` is installed.

Each is timed with CUDA events (METHOD.md of the device tool): a warm-up of 10 calls, then
the median of 50, the inputs rotated among 3 sets so no run reads another's cache. The
outputs and gradients are compared with cuDNN's (max abs and relative norm). TFLOP/s count
causal attention as half the full products: forward ``2 * 2 * B * Hq * S * S * D / 2``,
forward+backward 3.5 times that (the backward recomputes the scores). Writes
``benchmarks/results/attention_fa4_<card>.json``.

    python benchmarks/attention_fa4_gpu.py [--copy-to DIR] [--quick]

flash-attn-4 installed with ``pip install --target DIR`` (wheels carried to a machine without
a registry) needs the directory its ``.pth`` file would add, as ``pip install`` into a
site-packages does: ``PYTHONPATH=DIR/nvidia_cutlass_dsl/dsl_packages:DIR:.``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
import _timing  # noqa: E402

SHAPES = [  # name, query heads, kv heads, head dim, batch, sequence
    ("tinyllama", 32, 4, 64, 8, 2048), ("tinyllama", 32, 4, 64, 2, 8192),
    ("llama3-8b", 32, 8, 128, 8, 2048), ("llama3-8b", 32, 8, 128, 2, 8192),
]


def _sdpa(backend):
    def fn(q, k, v):           # (B, H, S, D)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return fn


def _fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as e:
        return None, f"flash-attn-4 not importable: {e}"

    def fn(q, k, v):           # (B, S, H, D)
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out
    return fn, None


def _inputs(b, s, hq, hkv, d, layout, gen):
    def one(h):
        shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_()
    return one(hq), one(hkv), one(hkv)


def _time(fn, sets, reps: int) -> float:
    return _timing.median_ms(fn, sets, reps, warmup=10)


def _fwd_bwd(fn):
    def run(q, k, v, g):
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), g)
    return run


def _compare(ref, got) -> dict:
    out = {}
    for name, r, x in zip(("out", "dq", "dk", "dv"), ref, got):
        r, x = r.float(), x.float()
        out[name] = {"max_abs": float((r - x).abs().max()),
                     "rel": float((r - x).norm() / r.norm().clamp_min(1e-30))}
    return out


def _run_shape(shape, variants, reps):
    name, hq, hkv, d, b, s = shape
    flops = 2 * 2 * b * hq * s * s * d / 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    ref_in = _inputs(b, s, hq, hkv, d, "bhsd", gen)
    g_bhsd = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = _sdpa(SDPBackend.CUDNN_ATTENTION)(*ref_in)
    ref = (out, *torch.autograd.grad(out, ref_in, g_bhsd))
    row = {"shape": name, "heads": hq, "kv_heads": hkv, "head_dim": d, "batch": b, "seq": s,
           "variants": {}}
    for vname, (fn, layout) in variants.items():
        try:
            sets = [_inputs(b, s, hq, hkv, d, layout, gen) for _ in range(3)]
            grads = [g_bhsd if layout == "bhsd" else g_bhsd.transpose(1, 2).contiguous()
                     for _ in sets]
            # correctness on the reference's own values, in this variant's layout
            xs = [t.detach().clone() if layout == "bhsd" else
                  t.detach().transpose(1, 2).contiguous() for t in ref_in]
            xs = [t.requires_grad_() for t in xs]
            o = fn(*xs)
            got = (o, *torch.autograd.grad(o, xs, grads[0]))
            if layout == "bshd":
                got = tuple(t.transpose(1, 2) for t in got)
            fwd = _time(lambda q, k, v, g: fn(q, k, v), [(*x, gg) for x, gg in zip(sets, grads)],
                        reps)
            both = _time(_fwd_bwd(fn), [(*x, gg) for x, gg in zip(sets, grads)], reps)
            row["variants"][vname] = {
                "fwd_ms": fwd, "fwd_bwd_ms": both,
                "fwd_tflops": flops / fwd / 1e9, "fwd_bwd_tflops": 3.5 * flops / both / 1e9,
                "vs_cudnn": _compare(ref, got)}
        except Exception as e:            # noqa: BLE001 -- a variant that cannot run says why
            row["variants"][vname] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--quick", action="store_true", help="10 timed calls instead of 50")
    args = ap.parse_args()
    fa4, why = _fa4()
    variants = {"sdpa_cudnn": (_sdpa(SDPBackend.CUDNN_ATTENTION), "bhsd"),
                "sdpa_flash": (_sdpa(SDPBackend.FLASH_ATTENTION), "bhsd")}
    if fa4 is not None:
        variants["fa4"] = (fa4, "bshd")
    rows = [_run_shape(s, variants, 10 if args.quick else 50) for s in SHAPES]
    card = torch.cuda.get_device_name()
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}
    try:
        import importlib.metadata as md

        versions["flash-attn-4"] = md.version("flash-attn-4")
        versions["nvidia-cutlass-dsl"] = md.version("nvidia-cutlass-dsl")
    except Exception:                     # noqa: BLE001 -- not installed: recorded as absent
        versions["flash-attn-4"] = None
    out = {"script": "benchmarks/attention_fa4_gpu.py", "card": card, "versions": versions,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "fa4_unavailable": why, "rows": rows}
    path = _results.write("attention_fa4", card, out, args.copy_to)
    print(f"wrote {path}")
    print(f"{'shape':<10}{'B x S':>10}  {'variant':<11}{'fwd ms':>9}{'TF/s':>7}"
          f"{'f+b ms':>9}{'TF/s':>7}  {'rel err (out, dq)':>18}")
    for r in rows:
        for v, m in r["variants"].items():
            if "error" in m:
                print(f"{r['shape']:<10}{r['batch']:>4} x {r['seq']:<5}  {v:<11}{m['error'][:60]}")
                continue
            e = m["vs_cudnn"]
            print(f"{r['shape']:<10}{r['batch']:>4} x {r['seq']:<5}  {v:<11}{m['fwd_ms']:>9.3f}"
                  f"{m['fwd_tflops']:>7.0f}{m['fwd_bwd_ms']:>9.3f}{m['fwd_bwd_tflops']:>7.0f}"
                  f"  {e['out']['rel']:.1e}, {e['dq']['rel']:.1e}")


if __name__ == "__main__":
    main()
