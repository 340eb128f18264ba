"""A gated (SwiGLU) MLP's forward and backward, bf16: meshlab's fused MLP against
products with the activation in their epilogues (quack-kernels' CuTe-DSL GEMMs) and
against plain torch.

Shapes: TinyLlama-1.1B's MLP (hidden 2048, intermediate 5632) at 8 x 2048 tokens and
Llama-3-8B's (4096, 14336) at 2 x 4096. Variants, each given the weights as Hugging
Face's modules hold them (gate, up and down apart):

* ``torch``          -- ``F.linear(silu(F.linear(x, g)) * F.linear(x, u), d)``;
* ``meshlab``        -- ``meshlab.ops.swiglu_mlp`` (cuBLAS products, the activation and its
  backward in Triton kernels, the input gradient summed inside the second product);
* ``meshlab_quack``  -- ``swiglu_mlp`` with its quack-kernels route on (``QUACK_MLP``): the
  ``quack_cat`` call behind meshlab's function;
* ``quack``          -- ``quack.mlp.mlp_func(..., activation='swiglu', concat_layout=True)``:
  the gate and up products as one GEMM whose epilogue writes the activation, the down
  product's input-gradient GEMM whose epilogue writes the activation's gradient; the
  gate and up weights concatenated once, outside the timed call (the layout a model
  built for it would hold);
* ``quack_cat``      -- the same with the concatenation inside each call (what routing a
  Hugging Face MLP to it costs), its gradient split back by autograd;
* ``quack_untuned``  -- ``quack`` with its default tile configuration (no autotuning).

Each variant is timed with CUDA events (METHOD.md): warm-up of 5 calls, median of 30, the
inputs rotated among 2 sets. Outputs and gradients are compared with the same MLP in
float32. Writes ``benchmarks/results/mlp_<card>.json``.

    python benchmarks/mlp_gpu.py [--copy-to DIR] [--reps N]

quack-kernels installed with ``pip install --target DIR`` needs the directory its ``.pth``
file would add: ``PYTHONPATH=DIR/nvidia_cutlass_dsl/python_packages:DIR:.`` for
nvidia-cutlass-dsl 4.5.3 (``dsl_packages`` for 4.6 on, whose wheels lack the CuTe DSL's
Python package; see ``NOTES.md``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
import _timing  # noqa: E402

SHAPES = [("tinyllama", 2048, 5632, 16384), ("llama3-8b", 4096, 14336, 8192)]


def _torch(x, g, u, d):
    return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)


def _meshlab():
    from meshlab.ops.swiglu import swiglu_mlp

    return swiglu_mlp


def _meshlab_quack():
    """``swiglu_mlp`` with its quack-kernels route turned on (``QUACK_MLP``)."""
    from meshlab.ops import swiglu as _  # noqa: F401 -- the module, loaded
    S = sys.modules["meshlab.ops.swiglu"]

    def fn(x, g, u, d):
        S.QUACK_MLP = True
        try:
            return S.swiglu_mlp(x, g, u, d)
        finally:
            S.QUACK_MLP = False
    return fn


def _quack(cat_each_call: bool, tuned: bool):
    from quack.mlp import mlp_func

    def fn(x, g, u, d, gu=None):
        w1 = torch.cat([g, u]) if cat_each_call or gu is None else gu
        return mlp_func(x, w1, d, activation="swiglu", tuned=tuned, concat_layout=True)
    return fn


def _time(fn, sets, reps: int) -> float:
    return _timing.median_ms(fn, sets, reps, warmup=5)


def _inputs(h, i, t, gen):
    def r(*shape, scale=1.0):
        return (torch.randn(shape, device="cuda", generator=gen) * scale).to(
            torch.bfloat16).requires_grad_()
    return (r(t, h), r(i, h, scale=h ** -0.5), r(i, h, scale=h ** -0.5),
            r(h, i, scale=i ** -0.5), torch.randn(t, h, device="cuda", generator=gen).to(
                torch.bfloat16))


def _grads(fn, x, g, u, d, dout, concat: bool):
    """Output and the gradients of x, g, u, d (with ``concat``: the weights handed over
    concatenated, the gradient of the concatenation split)."""
    if concat:
        gu = torch.cat([g, u]).detach().requires_grad_()
        out = fn(x, g, u, d, gu)
        dx, dgu, dd = torch.autograd.grad(out, (x, gu, d), dout)
        dg, du = dgu.chunk(2)
    else:
        out = fn(x, g, u, d)
        dx, dg, du, dd = torch.autograd.grad(out, (x, g, u, d), dout)
    return out, dx, dg, du, dd


def _run_shape(shape, variants, reps: int) -> dict:
    name, h, i, t = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [_inputs(h, i, t, gen) for _ in range(2)]
    x, g, u, d, dout = sets[0]
    f32 = [a.detach().float().requires_grad_() for a in (x, g, u, d)]
    ref = (_torch(*f32), *torch.autograd.grad(_torch(*f32), f32, dout.float()))
    flops = 2 * t * h * i * 3 * 3          # three products, forward and two backward each
    row = {"shape": name, "hidden": h, "intermediate": i, "tokens": t, "variants": {}}
    for vname, (fn, concat) in variants.items():
        try:
            got = _grads(fn, x, g, u, d, dout, concat)
            err = {k: float((r - o.float()).norm() / r.norm()) for k, r, o in
                   zip(("out", "dx", "dgate", "dup", "ddown"), ref, got)}
            del got
            timed_sets = []
            for (sx, sg, su, sd, sdo) in sets:
                gu = torch.cat([sg, su]).detach().requires_grad_() if concat else None
                timed_sets.append((sx, sg, su, sd, sdo, gu))

            def both(sx, sg, su, sd, sdo, gu):
                out = fn(sx, sg, su, sd, gu) if concat else fn(sx, sg, su, sd)
                ins = (sx, gu, sd) if concat else (sx, sg, su, sd)
                torch.autograd.grad(out, ins, sdo)

            def fwd(sx, sg, su, sd, sdo, gu):
                with torch.no_grad():
                    fn(sx, sg, su, sd, gu) if concat else fn(sx, sg, su, sd)

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = _time(both, timed_sets, reps)
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            row["variants"][vname] = {"fwd_bwd_ms": ms, "fwd_ms": _time(fwd, timed_sets, reps),
                                      "tflops": flops / ms / 1e9, "peak_extra_gib": peak,
                                      "rel_err_vs_fp32": err}
        except Exception as e:            # noqa: BLE001 -- a variant that cannot run says why
            row["variants"][vname] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        torch.cuda.empty_cache()
        r = row["variants"][vname]          # as each variant ends (autotuning can be long)
        print(name, vname, {k: r[k] for k in r if k != "rel_err_vs_fp32"},
              r.get("rel_err_vs_fp32"), flush=True)
    return row


def _products(shape, reps: int) -> dict:
    """The MLP's input-side products alone, as two (gate, up) or merged into one over the
    concatenated weights: forward ``x @ W.T``, input gradient ``dY @ W`` (as two products
    and an ``addmm_``), weight gradient ``dY.T @ x``."""
    name, h, i, t = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, h, **bf, generator=gen)
    wg, wu = (torch.randn(i, h, **bf, generator=gen) for _ in range(2))
    wgu = torch.cat([wg, wu])
    dgu = torch.randn(t, 2 * i, **bf, generator=gen)
    dg, du = dgu[:, :i].contiguous(), dgu[:, i:].contiguous()

    def dx_two():
        y = dg @ wg
        y.addmm_(du, wu)

    cases = {"fwd_two": lambda: (x @ wg.T, x @ wu.T), "fwd_one": lambda: x @ wgu.T,
             "dx_two": dx_two, "dx_one": lambda: dgu @ wgu,
             "dw_two": lambda: (dg.T @ x, du.T @ x), "dw_one": lambda: dgu.T @ x,
             "cat_weights": lambda: torch.cat([wg, wu])}
    flops = 2 * t * h * 2 * i
    out = {"shape": name}
    for k, fn in cases.items():
        ms = _time(lambda: fn(), [()], reps)
        out[k] = {"ms": ms, "tflops": flops / ms / 1e9 if k != "cat_weights" else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default="tinyllama,llama3-8b")
    ap.add_argument("--variants", default=None, help="default: all; in the order given")
    args = ap.parse_args()
    variants = {"torch": (lambda x, g, u, d: _torch(x, g, u, d), False),
                "meshlab": (_meshlab(), False), "meshlab_quack": (_meshlab_quack(), False)}
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import quack

        versions["quack-kernels"] = getattr(quack, "__version__", "?")
        variants["quack_untuned"] = (_quack(False, tuned=False), True)
        variants["quack"] = (_quack(False, tuned=True), True)
        variants["quack_cat"] = (_quack(True, tuned=True), False)
        missing = None
    except ImportError as e:
        missing = f"quack-kernels not importable: {e}"
    if args.variants:
        variants = {v: variants[v] for v in args.variants.split(",") if v in variants}
    rows = []
    for shape in SHAPES:
        if shape[0] in args.shapes.split(","):
            rows.append(_run_shape(shape, variants, args.reps))
    products = [_products(shape, args.reps) for shape in SHAPES
                if shape[0] in args.shapes.split(",")]
    for p in products:
        print(p, flush=True)
    card = torch.cuda.get_device_name()
    out = {"script": "benchmarks/mlp_gpu.py", "card": card, "versions": versions,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "quack_unavailable": missing, "reps": args.reps, "rows": rows,
           "products": products}
    print(_results.write("mlp", card, out, args.copy_to))


if __name__ == "__main__":
    main()
