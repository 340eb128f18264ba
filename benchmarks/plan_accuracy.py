"""How close the plan's predictions are to what one H200 measures: peak memory and step time
for a sweep of single-GPU configurations (1B and 8B Llama shapes; batch, sequence, remat,
fuse, ZeRO-3 at world 1, optimizer offload).

    PYTHONPATH=. python benchmarks/plan_accuracy.py [--copy-to DIR] [--only NAME,...]

The card is measured first (``meshlab.calibrate``: matmul, elementwise, attention, launch
and host-copy rates); the predictions use that profile, never the training runs. Each row
trains ``warmup`` then ``steps`` steps through ``ml.parallelize`` + ``ml.step`` (bf16
parameters, torch's fused AdamW); measured = the median step (CUDA events) and
``max_memory_allocated`` over the timed steps; predicted = ``plan.memory(batch=,
seq=).peak`` and ``plan.time(batch=, seq=).step`` of the same spec on a fake mesh of one.
Writes ``results/plan_accuracy[_<shape>]_<card>.json`` after every row.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from _timing import cuda_times  # noqa: E402

SHAPES = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               rope_theta=500000.0),
}
# name: (shape, batch, seq, spec builder)
ROWS = {
    "1b_b8_s2048": ("1b", 8, 2048, lambda ml: None),
    "1b_b8_s2048_fuse": ("1b", 8, 2048, lambda ml: ml.fuse()),
    "1b_b8_s2048_full": ("1b", 8, 2048, lambda ml: ml.remat("full")),
    "1b_b8_s2048_selective": ("1b", 8, 2048, lambda ml: ml.remat("selective")),
    "1b_b4_s4096": ("1b", 4, 4096, lambda ml: None),
    "1b_b16_s1024_fuse_selective": ("1b", 16, 1024,
                                    lambda ml: ml.fuse() | ml.remat("selective")),
    "1b_b1_s2048": ("1b", 1, 2048, lambda ml: None),
    "1b_b8_s2048_zero3": ("1b", 8, 2048, lambda ml: ml.zero_shard(3, "dp")),
    "1b_b8_s2048_offload": ("1b", 8, 2048, lambda ml: ml.offload(optimizer=1.0)),
    "8b_b2_s4096_full": ("8b", 2, 4096, lambda ml: ml.remat("full")),
    "8b_b1_s4096_selective": ("8b", 1, 4096, lambda ml: ml.remat("selective")),
    "8b_b2_s4096_fuse_full": ("8b", 2, 4096, lambda ml: ml.fuse() | ml.remat("full")),
    "8b_b2_s4096_offload_full": ("8b", 2, 4096,
                                 lambda ml: ml.offload(optimizer=1.0) | ml.remat("full")),
}


def _config(shape: str, seq: int):
    import transformers

    return transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=seq,
                                    tie_word_embeddings=False, attn_implementation="sdpa",
                                    use_cache=False)


def _meta_model(shape: str, seq: int):
    import transformers

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(_config(shape, seq)).to(torch.bfloat16)


def predict(name: str, card) -> dict:
    import meshlab as ml
    from meshlab.estimate.profile import _COUNTS, profile

    shape, batch, seq, make = ROWS[name]
    plan = ml.plan(_meta_model(shape, seq), make(ml), ml.Mesh(dp=1, fake=True))
    mem = plan.memory(batch=batch, seq=seq)
    st = plan.time(batch=batch, seq=seq, gpu=card)
    counts = {"/".join(k): {f: getattr(w, f) for f in _COUNTS}       # the host model's inputs
              for k, w in profile(plan.source, plan, batch, seq).work.items()}
    return {"op_counts": counts, "peak_GiB": mem.peak / 2 ** 30,
            "saved_GiB": mem.activations.saved / 2 ** 30,
            "persistent_GiB": mem.persistent / 2 ** 30, "ms_per_step": st.step * 1e3,
            "compute_ms": st.compute * 1e3, "extra_ms": st.extra * 1e3,
            "kinds_ms": {k: v * 1e3 for k, v in st.kinds}}


def measure(name: str, steps: int, warmup: int, parts: bool = False) -> dict:
    import meshlab as ml

    shape, batch, seq, make = ROWS[name]
    import transformers

    spec = make(ml)
    torch.manual_seed(0)
    with torch.device("cuda"):      # initialized on the card (a meta model would be on the host)
        model = transformers.LlamaForCausalLM(_config(shape, seq)).to(torch.bfloat16)
    model = ml.parallelize(model, spec, ml.Mesh(dp=1))
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-5, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq), device="cuda",
                        generator=g)
    data = {"input_ids": ids}
    for _ in range(warmup):
        ml.step(model, opt, data)
    times = cuda_times(lambda: ml.step(model, opt, data), steps)
    out = {"ms_per_step": statistics.median(times), "step_ms": times,
           "peak_GiB": torch.cuda.max_memory_allocated() / 2 ** 30}
    if parts:
        out["parts"] = kernel_parts(lambda: ml.step(model, opt, data))
    del model, opt
    return out


def kernel_parts(step, steps: int = 2) -> dict:
    """Where a step's GPU time goes (``torch.profiler``): kernel milliseconds per step by
    kind, the idle gaps, kernels per step, and each matmul / attention op's CUDA time by
    input shape (what a shape-aware rate is fitted to)."""
    from torch.profiler import ProfilerActivity, profile

    import profile_step

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
                 record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_kind: dict = {}
    kernels = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not profile_step._annotation(
                e.name):
            k = profile_step.kind(e.name)
            by_kind[k] = by_kind.get(k, 0.0) + e.device_time_total / 1e3 / steps
            kernels += 1
    ops = []
    for a in prof.key_averages(group_by_input_shape=True):
        if a.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") or \
                "attention" in a.key:
            ops.append({"op": a.key, "shapes": [list(x) for x in a.input_shapes if x][:4],
                        "calls": a.count / steps,
                        "cuda_ms": a.self_device_time_total / 1e3 / steps})
    ops.sort(key=lambda o: -o["cuda_ms"])
    return {"by_kind_ms": by_kind, "kernels": kernels / steps,
            "idle_ms": profile_step.idle_gaps(prof, steps)["idle_ms"], "ops": ops[:60]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None,
                    help="only this shape's rows; the JSON is named after it")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--parts", action="store_true",
                    help="also profile each row: kernel time by kind and matmul time by shape")
    args = ap.parse_args()
    import torch.distributed as dist

    import meshlab as ml

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    card = ml.calibrate(progress=lambda s: print("calibrate:", s, flush=True))
    rows = args.only.split(",") if args.only else [
        n for n in ROWS if args.shape is None or ROWS[n][0] == args.shape]
    results = {}
    prefix = "plan_accuracy" + (f"_{args.shape}" if args.shape else "")
    for name in rows:
        r: dict = {"batch": ROWS[name][1], "seq": ROWS[name][2],
                   "spec": repr(ROWS[name][3](ml))}
        try:
            r["predicted"] = predict(name, card)
            r["measured"] = measure(name, args.steps, args.warmup, args.parts)
            p, m = r["predicted"], r["measured"]
            r["peak_error"] = p["peak_GiB"] / m["peak_GiB"] - 1
            r["time_error"] = p["ms_per_step"] / m["ms_per_step"] - 1
            print(f"{name:>30}: peak {m['peak_GiB']:6.2f} GiB measured, {p['peak_GiB']:6.2f} "
                  f"planned ({100 * r['peak_error']:+5.1f}%); step {m['ms_per_step']:7.1f} ms "
                  f"measured, {p['ms_per_step']:7.1f} planned ({100 * r['time_error']:+5.1f}%)",
                  flush=True)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            r["traceback"] = traceback.format_exc()[-2500:]
            print(f"{name:>30}: failed: {r['error'][:300]}", flush=True)
        results[name] = r
        gc.collect()
        torch.cuda.empty_cache()
        _write(prefix, card, args, results)        # after every row: a cut run keeps its rows
    dist.destroy_process_group()


def _write(prefix, card, args, results) -> None:
    import transformers

    dev = torch.cuda.get_device_properties(0)
    ok = [r for r in results.values() if "peak_error" in r]
    out = {"card": dev.name, "torch": torch.__version__,
           "transformers": transformers.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": card.to_json(),
           "method": f"median of {args.steps} steps (CUDA events) after {args.warmup} warm-up "
                     f"steps; peak = max_memory_allocated over the timed steps; predictions "
                     f"from meshlab.calibrate's rates on this card",
           "worst_peak_error": max((abs(r["peak_error"]) for r in ok), default=None),
           "worst_time_error": max((abs(r["time_error"]) for r in ok), default=None),
           "rows_planned": len(ROWS), "results": results}
    path = _results.write(prefix, dev.name, out, args.copy_to)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
