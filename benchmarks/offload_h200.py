"""``offload`` on one GPU: what trains, how fast, against no offload and FSDP2's own.

Each configuration runs in a process of its own (clean device and host memory), on a
Llama-2-shaped model built on the GPU from its config, fp32 parameters (the masters),
``precision('bf16')``, full activation checkpointing, sdpa attention, AdamW, ``--micro``
sequences of ``--seq`` tokens per microbatch and ``--accum`` microbatches per step:

* ``profile``   -- ``measure_profile()``: pinned copies each way, CPU AdamW throughput;
* ``7b_none``   -- 7B, no offload (everything on the device);
* ``7b_opt``    -- 7B, ``offload(optimizer=1.0)``: masters and moments on the host,
  bf16 parameters and gradients on the device;
* ``7b_fsdp``   -- 7B, FSDP2 ``fully_shard`` per block with ``CPUOffloadPolicy(pin_memory=
  True)`` and bf16 ``MixedPrecisionPolicy``, ``torch.optim.AdamW`` on the CPU;
* ``13b_opt``   -- 13B, ``offload(optimizer=--frac13)``.

Time: CUDA events around each step after one warm-up step, median of ``--steps``;
MFU = 6 * parameters * tokens / time / 989 TFLOP/s (H200 bf16 dense; attention not
counted). Peak device memory is ``max_memory_allocated``; host memory is the process's
peak resident set. Writes ``benchmarks/results/offload_<card>.json`` (and the profile to
``offload_profile_<card>.json``).

    python benchmarks/offload_h200.py [--configs profile,7b_none,7b_opt,13b_opt,7b_fsdp]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, vocab_size=32000),
}
PEAK_FLOPS = 989e12


def _model(shape: str, seq: int):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=seq,
                                   tie_word_embeddings=False, attn_implementation="sdpa",
                                   use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg)


def _init_dist():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("nccl", rank=0, world_size=1)


def _time_steps(step, steps: int) -> list[float]:
    from _timing import cuda_times

    step()                                  # warm-up (allocations, CPU AdamW build)
    return [ms / 1e3 for ms in cuda_times(step, steps)]


def _training_step(model, opt, args, set_sync):
    """One optimizer step over ``args.accum`` microbatches of the same random tokens
    (``set_sync(last)`` before each: gradients synchronize on the last), and the list the
    losses go to."""
    import torch

    import meshlab as ml

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 32000, (args.accum, args.micro, args.seq), device="cuda", generator=g)
    losses: list[float] = []

    def step():
        for i in range(args.accum):
            set_sync(i == args.accum - 1)
            x = ids[i]
            loss = ml.losses.causal_lm_loss(model(input_ids=x), {"input_ids": x, "labels": x})
            (loss / args.accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))

    return step, losses


def run_meshlab(shape: str, frac: float, args) -> dict:
    import torch

    import meshlab as ml
    from meshlab.transforms.offload._install import OffloadPart

    _init_dist()
    model = _model(shape, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    spec = ml.precision("bf16") | ml.remat("full")
    if frac > 0:
        spec = spec | ml.offload(optimizer=frac)
    model = ml.parallelize(model, spec, ml.Mesh(dp=1), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-5, fused=True)
    rt = model._meshlab
    step, losses = _training_step(model, opt, args,
                                  lambda last: rt.set_gradient_sync(model, last))
    times = _time_steps(step, args.steps)
    out = _summary(times, n_params, args)
    est = rt.plan.memory()
    out.update(first_loss=losses[0], losses=losses,
               plan_device_GiB=est.total / 2**30, plan_host_GiB=est.host / 2**30)
    part = rt.part(OffloadPart)
    if part is not None:
        m = part.measure(opt)
        out["measured_device_GiB"] = sum(m["device"].values()) / 2**30
        out["measured_host_GiB"] = sum(m["host"].values()) / 2**30
        cost = rt.plan.get(ml.parallel.Offload).step_cost(rt.plan, _profile())
        out["predicted_offload_s"] = cost.seconds
        out["host_updated_native"] = opt.inner.host_params != [] and \
            _native_path()
    return out


def _native_path() -> bool:
    from meshlab.ops import _build

    return _build.cpu_adam_kernels() is not None


def _profile():
    from meshlab.transforms.offload._estimates import Profile

    p = Path(_results_dir(), "offload_profile_h200.json")
    if p.exists():
        d = json.loads(p.read_text())["profile"]
        return Profile(d["h2d"], d["d2h"], d["cpu_adam"], "offload_profile_h200.json")
    return None


def _results_dir() -> Path:
    return Path(__file__).resolve().parent / "results"


def run_fsdp(shape: str, args) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _init_dist()
    model = _model(shape, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh("cuda", (1,))
    kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32))
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step, losses = _training_step(model, opt, args, model.set_requires_gradient_sync)
    times = _time_steps(step, args.fsdp_steps)
    out = _summary(times, n_params, args)
    out.update(first_loss=losses[0], losses=losses)
    return out


def _summary(times: list[float], n_params: int, args) -> dict:
    import torch

    tokens = args.accum * args.micro * args.seq
    s = statistics.median(times)
    return {"params": n_params, "tokens_per_step": tokens, "step_s": times, "median_step_s": s,
            "tokens_per_s": tokens / s, "mfu": 6 * n_params * tokens / s / PEAK_FLOPS,
            "peak_device_GiB": torch.cuda.max_memory_allocated() / 2**30,
            "peak_host_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_profile() -> dict:
    from meshlab.transforms.offload import measure_profile

    return {"profile": measure_profile(nbytes=1 << 30).to_json()}


def child(name: str, args) -> dict:
    if name == "profile":
        return run_profile()
    if name == "7b_none":
        return run_meshlab("7b", 0.0, args)
    if name == "7b_opt":
        return run_meshlab("7b", 1.0, args)
    if name == "13b_opt":
        args.accum = args.accum13
        return run_meshlab("13b", args.frac13, args)
    if name == "7b_fsdp":
        return run_fsdp("7b", args)
    raise SystemExit(f"unknown config {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="profile,7b_none,7b_opt,13b_opt")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--accum13", type=int, default=4)
    ap.add_argument("--frac13", type=float, default=0.65)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--fsdp-steps", type=int, default=1)
    ap.add_argument("--child", default=None)
    ap.add_argument("--copy-to", default=None)
    ap.add_argument("--timeout", type=int, default=400)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return
    import torch
    import transformers

    import _results

    path = _results_dir() / "offload_h200.json"
    prev = json.loads(path.read_text()) if path.exists() else {}
    results = dict(prev.get("results", {}))
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--child", name] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("configs", "child", "copy_to") and v is not None]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            results[name] = json.loads(line[-1][7:]) if line else {
                "error": (p.stderr or p.stdout)[-3000:]}
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"did not finish within {args.timeout} s"}
        r = results[name]
        print(name, json.dumps({k: v for k, v in r.items() if k not in ("step_s", "losses")})[:600],
              flush=True)
        if name == "profile" and "profile" in r:
            prof = {**r, "card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"),
                    "method": "measure_profile(nbytes=2**30): pinned copies each way, median "
                              "of 5 after one warm-up (CUDA events); CPU AdamW over 2**28 "
                              "fp32 parameters, median of 5 steps"}
            prof["profile"]["source"] = "offload_profile_h200.json"
            _results.write("offload_profile", torch.cuda.get_device_name(0), prof, args.copy_to)
    out = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "transformers": transformers.__version__, "cpus": os.cpu_count(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shapes": SHAPES, "seq": args.seq, "micro": args.micro, "accum": args.accum,
           "accum13": args.accum13, "frac13": args.frac13,
           "method": "one process per configuration; median of the timed steps (CUDA events) "
                     "after one warm-up step; MFU = 6 N tokens / time / 989e12",
           "results": results}
    a, b = results.get("7b_none", {}), results.get("7b_opt", {})
    if "tokens_per_s" in a and "tokens_per_s" in b:
        out["7b_opt_slowdown_per_token"] = a["tokens_per_s"] / b["tokens_per_s"] - 1
    c = results.get("7b_fsdp", {})
    if "tokens_per_s" in c and "tokens_per_s" in b:
        out["7b_opt_vs_fsdp_cpu_offload_speedup"] = b["tokens_per_s"] / c["tokens_per_s"]
    _results.write("offload", torch.cuda.get_device_name(0), out, args.copy_to)
    print(json.dumps({k: v for k, v in out.items() if "slowdown" in k or "speedup" in k}))


if __name__ == "__main__":
    main()
