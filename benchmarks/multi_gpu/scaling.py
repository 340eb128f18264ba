"""Training throughput per GPU of a ~1B and an 8B Llama under DP and ZeRO-3, bf16.

Models: ``llama-1b`` (hidden 2048, 16 layers, 16 heads, 8 KV heads, intermediate 5632,
vocabulary 32000) and ``llama3-8b`` (``meshlab.policies.presets``), SDPA attention, untied head.
Each (model, layout) is built on the meta device and parallelized once
(``ml.data_parallel('dp')`` or ``ml.zero_shard(3, 'dp')``, with ``ml.precision('bf16')``:
fp32 parameters and AdamW state, bf16 compute, fp32 gradient reduction; ``--remat
selective`` adds ``ml.remat('selective')``; ``--compile`` compiles every block's forward
after ``parallelize``), then trained at each sequence length with random tokens,
``--batch`` sequences per GPU, ``ml.step`` (AdamW, no clipping). ``--warmup`` untimed
steps, then ``--steps`` steps each timed with CUDA events (``time.perf_counter`` on the
CPU); the median step gives tokens/s/GPU = batch * seq / step time.

MFU = tokens/s/GPU * FLOPs per token / 989 TFLOP/s (H100/H200 dense bf16), FLOPs per
token = 6 N + 12 L d S (N: parameters except the input embedding table, whose lookup
does no matmul; the LM head counts; L layers, d hidden size, S sequence length).

``--baseline world1.json`` (this script's output from a world-1 run with the same
options) adds the fraction of the world-1 tokens/s/GPU each configuration keeps.
A layout whose parameters, gradients and AdamW state (``plan.memory()``) exceed 75% of a
GPU's memory is skipped with that reason (DP of the 8B model: ~120 GiB per rank); an
out-of-memory error is recorded, and the longer sequences of that layout are skipped.

    torchrun --nproc-per-node 8 benchmarks/multi_gpu/scaling.py --compile --remat selective
    torchrun --nproc-per-node 2 benchmarks/multi_gpu/scaling.py --device cpu --quick
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.nvlink_multicast_off()

import torch  # noqa: E402

PEAK_FLOPS = 989e12
FIT = 0.75      # state above this share of a GPU leaves too little for activations
LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                vocab_size=32000, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False)
QUICK = {   # the same shapes, scaled down for a dry run
    "llama-1b": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "llama3-8b": dict(hidden_size=64, intermediate_size=224, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}
TARGET = {"model": "llama3-8b", "seq": 8192, "layout": "zero3", "compile": True,
          "remat": "selective", "tokens_per_s_per_gpu_at_least": 6700}


def model_config(name: str, quick: bool):
    from transformers import AutoConfig

    from meshlab.policies import presets

    kw = dict(LLAMA_1B) if name == "llama-1b" else dict(presets.PRESETS[name])
    if quick:
        kw.update(QUICK[name])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def build(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def counts(model, cfg) -> dict:
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return {"params_total": total, "params_input_embedding": emb,
            "params_counted": total - emb}


def flops_per_token(n: int, cfg, seq: int) -> float:
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq


def spec_for(layout: str, remat: str):
    import meshlab as ml

    spec = ml.data_parallel("dp") if layout == "dp" else ml.zero_shard(3, "dp")
    spec = spec | ml.precision("bf16")
    if remat != "none":
        spec = spec | ml.remat(remat)
    return spec


def device_memory(env) -> int:
    if env.cuda:
        return torch.cuda.get_device_properties(env.device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, env.world)


def compile_blocks(model) -> int:
    import torch._dynamo

    cfg = torch._dynamo.config
    for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
              "accumulated_cache_size_limit"):
        if hasattr(cfg, k):
            setattr(cfg, k, max(getattr(cfg, k), 1024))
    mods = dict(model.named_modules())
    n = 0
    for b in model._meshlab.layout.blocks:
        if b in mods:
            blk = mods[b]
            blk.forward = torch.compile(blk.forward)
            n += 1
    return n


def run_one(env, args, name, cfg, layout, seqs) -> list[dict]:
    """Build, parallelize and time ``name`` under ``layout`` at every sequence length."""
    import meshlab as ml

    mesh = env.mesh(dp=env.world)
    spec = spec_for(layout, args.remat)
    base = {"model": name, "layout": layout, "batch_per_gpu": args.batch,
            "compile": bool(args.compile), "remat": args.remat}
    meta = build(cfg)
    n = counts(meta, cfg)
    plan = ml.plan(meta, spec, mesh)
    state = plan.memory().total
    cap = device_memory(env)
    if state > FIT * cap:
        why = (f"skipped: parameters, gradients and AdamW state are {state / 2**30:.1f} GiB "
               f"per rank (plan.memory()), more than {FIT:.0%} of {cap / 2**30:.1f} GiB")
        return [{**base, "seq": s, **n, "state_bytes_per_rank": state, "status": why}
                for s in seqs]
    rows = []
    t = time.perf_counter()
    try:
        model = ml.parallelize(meta, spec, mesh, seed=0)
        moved = 0
        if env.cuda and not args.meshlab_as_is:
            moved = C.place_on_device(model, env.device)
        compiled = compile_blocks(model) if args.compile else 0
        opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-5)
    except Exception as e:  # noqa: BLE001 - recorded
        err = C.describe_error(e)
        return [{**base, "seq": s, **n, **err} for s in seqs]
    build_s = time.perf_counter() - t
    timer = C.Timer(env)
    failed = None
    for seq in seqs:
        row = {**base, "seq": seq, **n, "state_bytes_per_rank": state,
               "build_s": round(build_s, 2), "tensors_moved_to_device": moved,
               "blocks_compiled": compiled}
        if failed is not None:
            # a step that raised may leave FSDP's state half-way; longer sequences need more
            row["status"] = f"skipped: sequence {failed} failed first"
            rows.append(row)
            continue
        g = torch.Generator().manual_seed(env.rank)
        x = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=g).to(env.device)
        batch = {"input_ids": x}
        losses = []

        def step():
            losses.append(ml.step(model, opt, batch))
        try:
            if env.cuda:
                torch.cuda.reset_peak_memory_stats(env.device)
            t0 = time.perf_counter()
            timer.run(step, warmup=args.warmup, repeats=0)
            env.sync()
            row["warmup_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            times = timer.run(step, warmup=0, repeats=args.steps, sync_ranks=False)
            env.sync()
            wall = time.perf_counter() - t0
            mine = {"ok": True, "median": C.median(times), "times": times, "wall": wall,
                    "peak": torch.cuda.max_memory_allocated(env.device) if env.cuda else None}
        except Exception as e:  # noqa: BLE001 - recorded (OOM included)
            mine = {"ok": False, "error": C.describe_error(e)}
        everyone = env.gather(mine)
        bad = [m for m in everyone if not m["ok"]]
        if bad:
            row.update(bad[0]["error"])
            failed = seq
            if env.cuda:
                torch.cuda.empty_cache()
        else:
            step_s = max(m["median"] for m in everyone)          # the slowest rank's median
            tps = args.batch * seq / step_s
            fpt = flops_per_token(n["params_counted"], cfg, seq)
            row.update({
                "status": "ok", "step_s_median": step_s,
                "step_s_rank0": everyone[0]["times"],
                "tokens_per_s_per_gpu": tps,
                "tokens_per_s_per_gpu_wall": args.batch * seq * args.steps /
                max(m["wall"] for m in everyone),
                "tokens_per_s_total": tps * env.world,
                "flops_per_token": fpt,
                "mfu": tps * fpt / PEAK_FLOPS if env.cuda else None,
                "peak_memory_bytes_max_rank": max(m["peak"] or 0 for m in everyone) or None,
                "loss_first_last": [losses[0], losses[-1]] if losses else None,
            })
        rows.append(row)
        if env.rank == 0:
            if row["status"] == "ok":
                mfu = f"  MFU {row['mfu']:.1%}" if row["mfu"] is not None else ""
                print(f"{name:10s} {layout:6s} seq {seq:5d}  {row['tokens_per_s_per_gpu']:10.1f}"
                      f" tokens/s/GPU{mfu}  step {row['step_s_median']:.3f}s", flush=True)
            else:
                print(f"{name:10s} {layout:6s} seq {seq:5d}  {row['status'][:200]}", flush=True)
    del model, opt
    gc.collect()
    if env.cuda:
        torch.cuda.empty_cache()
    return rows


def add_baseline(rows: list[dict], path: str) -> dict:
    data = json.loads(open(path).read())
    key = ("model", "layout", "seq", "batch_per_gpu", "compile", "remat")
    base = {tuple(r.get(k) for k in key): r for r in data.get("results", [])
            if r.get("status") == "ok"}
    for r in rows:
        b = base.get(tuple(r.get(k) for k in key))
        if r.get("status") == "ok" and b is not None:
            r["baseline_tokens_per_s_per_gpu"] = b["tokens_per_s_per_gpu"]
            r["fraction_kept"] = r["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
            r["fraction_kept_meets_0.95"] = r["fraction_kept"] >= 0.95
        elif r.get("status") == "ok":
            r["fraction_kept"] = None
            r["fraction_kept_note"] = "no matching ok row in the baseline"
    return {"path": path, "world_size": data.get("world_size"), "device": data.get("device"),
            "date": data.get("date")}


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--models", default="llama-1b,llama3-8b")
    p.add_argument("--layouts", default="dp,zero3")
    p.add_argument("--seqs", default=None, help="default 2048,4096,8192 (quick: 32,64)")
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; quick 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per sequence length (default 3, 5 with --compile; quick 1)")
    p.add_argument("--compile", action="store_true", help="torch.compile every block's forward")
    p.add_argument("--remat", default="none", choices=("none", "full", "selective"))
    p.add_argument("--baseline", default=None, help="a world-1 JSON of this script")
    args = p.parse_args()
    args.steps = args.steps or (2 if args.quick else 10)
    if args.warmup is None:
        args.warmup = 1 if args.quick else (5 if args.compile else 3)
    env = C.Env(args)
    seqs = [int(s) for s in (args.seqs or ("32,64" if args.quick else "2048,4096,8192"))
            .split(",")]
    rows: list[dict] = []
    models = {}
    t0 = time.perf_counter()
    for name in args.models.split(","):
        cfg = model_config(name, args.quick)
        models[name] = {k: getattr(cfg, k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings")}
        for layout in args.layouts.split(","):
            rows += run_one(env, args, name, cfg, layout, seqs)
    payload = {
        "conventions": {
            "tokens_per_s_per_gpu": "batch_per_gpu * seq / median step time (slowest rank)",
            "flops_per_token": "6 N + 12 L d S; N = parameters minus the input embedding",
            "peak_flops": PEAK_FLOPS, "mfu": "tokens/s/GPU * flops_per_token / peak (GPU only)",
            "precision": "ml.precision('bf16'): fp32 parameters and AdamW, bf16 compute",
            "optimizer": "AdamW lr 1e-5, no gradient clipping",
            "timer": "CUDA events per step" if env.cuda else "time.perf_counter per step",
            "attention": "sdpa",
        },
        "models": models, "seqs": seqs, "steps": args.steps, "warmup": args.warmup,
        "target": TARGET,
    }
    if args.baseline:
        payload["baseline"] = add_baseline(rows, args.baseline)
        kept = [r["fraction_kept"] for r in rows if r.get("fraction_kept") is not None]
        payload["min_fraction_kept"] = min(kept) if kept else None
    hit = [r for r in rows if r.get("status") == "ok" and all(
        r.get(k) == TARGET[k] for k in ("model", "seq", "layout", "compile", "remat"))]
    payload["target_row_present"] = bool(hit)
    payload["target_met"] = (hit[0]["tokens_per_s_per_gpu"] >=
                             TARGET["tokens_per_s_per_gpu_at_least"]) if hit and env.cuda else None
    payload["seconds_total"] = round(time.perf_counter() - t0, 2)
    payload["results"] = rows
    C.write_json(env, "scaling", payload)
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
