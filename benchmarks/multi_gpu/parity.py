"""Parity of every parallel layout with the single-device model, on the GPUs at hand.

For each layout that fits the world size (DP, ZeRO-1/2/3, TP, TP+SP, PP 1F1B,
interleaved and zero-bubble, and at world 8 a 3-D mesh pp=2 x dp=2 x tp=2 with ZeRO-1)
and each precision (fp32, bf16), a small Llama built from a config and initialized with a
fixed seed trains ``--steps`` AdamW steps on a fixed global batch through
``ml.parallelize`` / ``ml.optimizer`` / ``ml.step``. Rank 0 also trains the
single-device reference: ``ml.init_weights(model, seed)`` and plain torch (AdamW, the same
global batch; bf16 under ``torch.autocast``). Reported per layout: the loss of every step
on both sides and their differences, and the largest weight difference after the last
step (every rank sends its full parameters to rank 0).

Pass (the losses): fp32 |a - b| <= 1e-5 + 1e-3 |b| at every step; bf16 |a - b| <= 5e-3 |b|.
The fp32 weights are also checked at the tests' tolerance (1e-4 + 1e-3 |b|), reported as
``weights_pass``. A layout that does not fit the world is listed with the reason; one
meshlab refuses or fails on is recorded as ``unsupported: <error>``.

    torchrun --nproc-per-node 8 benchmarks/multi_gpu/parity.py
    torchrun --nproc-per-node 2 benchmarks/multi_gpu/parity.py --device cpu --quick
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

C.nvlink_multicast_off()

import torch  # noqa: E402

LAYOUTS = ("dp", "zero1", "zero2", "zero3", "tp", "tp_sp", "pp_1f1b", "pp_interleaved",
           "pp_zero_bubble", "pp2_dp2_tp2_zero1")
PRECISIONS = ("fp32", "bf16")
TOL = {"fp32": {"loss_atol": 1e-5, "loss_rtol": 1e-3, "weight_atol": 1e-4, "weight_rtol": 1e-3},
       "bf16": {"loss_atol": 0.0, "loss_rtol": 5e-3}}
TP_RULES = dict(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)

MODEL = {   # a small Llama; --quick uses the tests' tiny sizes
    "full": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=1000),
    "quick": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97),
}
DATA = {"full": dict(batch=16, seq=64), "quick": dict(batch=16, seq=16)}


class Skip(Exception):
    """The layout does not fit this world or model (not a meshlab failure)."""


def build(cfg: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.for_model("llama", tie_word_embeddings=False, max_position_embeddings=512,
                             **cfg)
    c._attn_implementation = "eager"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(c)


def layout(name: str, world: int, cfg: dict, data: dict):
    """(mesh axes, transform, description) of ``name`` on ``world`` ranks, or Skip."""
    import meshlab as ml

    heads, kv, layers = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                         cfg["num_hidden_layers"])
    batch, seq = data["batch"], data["seq"]
    if name == "dp":
        return {"dp": world}, ml.data_parallel("dp")
    if name.startswith("zero"):
        return {"dp": world}, ml.zero_shard(int(name[-1]), "dp")
    if name in ("tp", "tp_sp"):
        if world < 2:
            raise Skip("tensor parallelism needs at least 2 ranks")
        tp = min(world, 4)
        if world % tp or heads % tp:
            raise Skip(f"tp={tp} does not divide world {world} / {heads} heads")
        rules = ml.Rules(**TP_RULES)
        if name == "tp_sp":
            if seq % tp:
                raise Skip(f"sequence {seq} does not divide over tp={tp}")
            rules = rules | ml.Rules(seq="tp")
        return {"dp": world // tp, "tp": tp}, ml.shard(ml.policies.auto, rules)
    if name.startswith("pp_"):
        if world < 2:
            raise Skip("pipeline parallelism needs at least 2 ranks")
        schedule = name[3:]
        pp = min(world, 4)
        if world % pp:
            raise Skip(f"pp={pp} does not divide world {world}")
        dp = world // pp
        v = 1 if schedule == "1f1b" else 2
        if layers < v * pp:
            raise Skip(f"{schedule} on pp={pp} needs {v * pp} blocks, the model has {layers}")
        mb = 2 * pp
        if (batch // dp) % mb or batch % dp:
            raise Skip(f"global batch {batch} does not split into dp={dp} x {mb} microbatches")
        spec = ml.pipeline("pp", schedule=schedule, microbatches=mb)
        axes = {"pp": pp}
        if dp > 1:
            axes["dp"] = dp
            spec = spec | ml.data_parallel("dp")
        return axes, spec
    if name == "pp2_dp2_tp2_zero1":
        if world != 8:
            raise Skip("the 3-D mesh pp=2 x dp=2 x tp=2 needs world 8")
        mb = 4
        if (batch // 2) % mb:
            raise Skip(f"global batch {batch} does not split into dp=2 x {mb} microbatches")
        spec = (ml.shard(ml.policies.auto, ml.Rules(**TP_RULES))
                | ml.pipeline("pp", schedule="1f1b", microbatches=mb) | ml.zero_shard(1, "dp"))
        return {"pp": 2, "dp": 2, "tp": 2}, spec
    raise KeyError(name)


def batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def reference(env, cfg, data, precision, lr, seed):
    """Rank 0: the single-device model on the whole global batch (losses, weights)."""
    import meshlab as ml

    model = ml.init_weights(build(cfg), seed=seed).to(env.device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for b in data:
        b = b.to(env.device)
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = ml.losses.causal_lm_loss(model(input_ids=b), {"input_ids": b})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def parallel(env, cfg, data, axes, spec, precision, lr, seed):
    """Every rank: the parallel model; returns (losses, this rank's full parameters)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import meshlab as ml

    mesh = env.mesh(**axes)
    if precision == "bf16":
        spec = spec | ml.precision("bf16")
    model = ml.parallelize(build(cfg), spec, mesh, seed=seed)
    moved = 0
    if env.cuda and not env.args.meshlab_as_is:
        moved = C.place_on_device(model, env.device)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=lr)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    losses = []
    for b in data:
        local = b.chunk(rt.dp_size)[dp_rank].to(env.device)
        losses.append(ml.step(model, opt, {"input_ids": local, "labels": local}))
    weights = {}
    for n, p in model.named_parameters():   # full_tensor is a collective: every rank calls
        w = p.full_tensor() if isinstance(p, DTensor) else p
        weights[n] = w.detach().float().cpu()
    return losses, weights, moved


def compare(precision, par, ref, wpar, wref):
    tol = TOL[precision]
    diffs = [abs(a - b) for a, b in zip(par, ref)]
    ok = len(par) == len(ref) and all(
        d <= tol["loss_atol"] + tol["loss_rtol"] * abs(b) for d, b in zip(diffs, ref))
    missing = sorted(set(wref) - set(wpar))
    worst, worst_name, wok = 0.0, None, not missing
    for n, r in wref.items():
        if n not in wpar:
            continue
        d = (wpar[n] - r).abs()
        m = float(d.max()) if d.numel() else 0.0
        if m > worst:
            worst, worst_name = m, n
        if precision == "fp32" and bool((d > tol["weight_atol"] + tol["weight_rtol"] *
                                         r.abs()).any()):
            wok = False
    return {"pass": bool(ok), "loss_parallel": par, "loss_reference": ref,
            "loss_abs_diff": diffs,
            "loss_rel_diff": [d / abs(b) if b else None for d, b in zip(diffs, ref)],
            "max_weight_abs_diff": worst, "max_weight_diff_param": worst_name,
            "weights_pass": bool(wok) if precision == "fp32" else None,
            "params_missing": missing}


def main() -> int:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="AdamW steps (default 5; quick 3)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    args = p.parse_args()
    env = C.Env(args)
    if env.cuda:   # fp32 means fp32: no TF32 in matmuls or convolutions
        try:
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            torch.backends.cudnn.conv.fp32_precision = "ieee"
        except AttributeError:      # torch before the fp32_precision switches
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    size = "quick" if args.quick else "full"
    cfg, dshape = MODEL[size], DATA[size]
    steps = args.steps or (3 if args.quick else 5)
    data = batches(steps, dshape["batch"], dshape["seq"], cfg["vocab_size"])
    results: dict = {}
    t_all = time.perf_counter()
    for name in args.layouts.split(","):
        for prec in args.precisions.split(","):
            key = f"{name}/{prec}"
            row: dict = {"layout": name, "precision": prec}
            try:
                axes, spec = layout(name, env.world, cfg, dshape)
            except Skip as e:
                row["status"] = f"skipped: {e}"
                results[key] = row
                if env.rank == 0:
                    print(f"{key:28s} skipped: {e}", flush=True)
                continue
            row["mesh"], row["spec"] = axes, repr(spec)
            t = time.perf_counter()
            ref = None
            try:
                if env.rank == 0:
                    ref = reference(env, cfg, data, prec, args.lr, args.seed)
                losses, weights, moved = parallel(env, cfg, data, axes, spec, prec, args.lr,
                                                  args.seed)
                mine = {"ok": True, "losses": losses, "weights": weights, "moved": moved}
            except Exception as e:  # noqa: BLE001 - recorded, the other layouts go on
                mine = {"ok": False, "error": C.describe_error(e)}
            everyone = env.gather(mine)
            row["seconds"] = round(time.perf_counter() - t, 3)
            if env.rank == 0:
                bad = [(r, m["error"]) for r, m in enumerate(everyone) if not m["ok"]]
                if bad:
                    row.update(bad[0][1])
                    row["failed_ranks"] = [r for r, _ in bad]
                else:
                    wpar: dict = {}
                    for m in everyone:
                        for n, w in m["weights"].items():
                            wpar.setdefault(n, w)
                    row["tensors_moved_to_device"] = everyone[0]["moved"]
                    row["ranks_agree_on_losses"] = all(m["losses"] == everyone[0]["losses"]
                                                       for m in everyone)
                    row.update(compare(prec, everyone[0]["losses"], ref[0], wpar, ref[1]))
                    row["status"] = "pass" if row["pass"] else "FAIL"
                shown = row["status"] if bad else (
                    f"{row['status']}  max|dloss| {max(row['loss_abs_diff']):.2e}  "
                    f"max|dw| {row['max_weight_abs_diff']:.2e}")
                print(f"{key:28s} {shown[:200]}  ({row['seconds']:.1f}s)", flush=True)
            results[key] = row
    summary = {}
    if env.rank == 0:
        for k, r in results.items():
            s = r["status"]
            summary[k] = s if s in ("pass", "FAIL") else s.split(":", 1)[0]
    payload = {
        "model": {"model_type": "llama", **cfg, "attn_implementation": "eager",
                  "tie_word_embeddings": False},
        "data": {**dshape, "steps": steps, "lr": args.lr, "seed": args.seed,
                 "optimizer": "AdamW (torch defaults otherwise)"},
        "tolerances": {**TOL, "rule": "|a-b| <= atol + rtol*|b| at every step (weights: "
                                      "every element, fp32 only)"},
        "fp32_matmul": "ieee (TF32 off)" if env.cuda else "cpu",
        "summary": summary,
        "all_ran_passed": all(v == "pass" for v in summary.values()
                              if v not in ("skipped",)),
        "seconds_total": round(time.perf_counter() - t_all, 2),
        "results": results,
    }
    C.write_json(env, "parity", payload)
    env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
