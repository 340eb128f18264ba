"""What the ranks' agreements on contents cost, against a training step (CPU, gloo).

Two gloo processes train a small Llama (hidden 256, 4 layers, vocabulary 4096, batch 8 x
128 tokens per data-parallel rank) with ``meshlab.step`` and ``meshlab.optimizer`` under
data parallelism (dp=2) and tensor parallelism (tp=2). Timed, as medians over
``--steps`` calls after warm-up:

* ``step_ms``: a whole step as shipped (the step's agreement with the batch digest and the
  optimizer's hyper-parameters, the forward-and-loss section's closing agreement, the
  tensor-parallel dropout streams), the replica check off;
* ``step_no_section_ms``: the same step without the forward-and-loss section's agreement;
* ``step_bare_ms``: without that agreement and without the content digests (what a step
  cost before them);
* ``agree_ms``: one bare agreement exchange (a section's end, an expert boundary);
* ``step_agreement_ms``: the step's own exchange with the batch and hyper-parameters;
* ``replica_check_ms``: one check of every parameter against its replicas.

The replica check's default period (``meshlab.train._content.CHECK_EVERY``) is the
smallest round number of steps at which ``replica_check_ms / period`` stays under 1% of
``step_ms`` in every layout measured. Writes ``benchmarks/results/agreement_cost_<tag>.json``.

    python benchmarks/agreement_cost.py [--steps 30] [--tag vm]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)
BATCH, SEQ = 8, 128


def _model(layout: str):
    import transformers

    import meshlab as ml

    cfg = transformers.LlamaConfig(**CONFIG)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    if layout == "dp":
        return ml.parallelize(model, ml.data_parallel("dp"), ml.Mesh(dp=2), seed=0)
    rules = ml.Rules(batch=("dp", None), heads="tp", kv_heads="tp", mlp="tp", vocab="tp",
                     embed=None)
    return ml.parallelize(model, ml.shard(ml.policies.auto, rules), ml.Mesh(dp=1, tp=2),
                          seed=0)


def _median_ms(fn, n: int) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


@contextlib.contextmanager
def _without(digests: bool, sections: bool):
    """The step without the content digests and/or the forward-and-loss section (the
    model's own forward section off too, or it would agree in the step's place)."""
    import meshlab.apply.materialize as A
    import meshlab.train.step as S

    saved = S.batch_peers, S.hyperparameters, S.section, A.section
    if digests:
        S.batch_peers = S.hyperparameters = lambda *a, **k: {}
    if sections:
        S.section = A.section = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        S.batch_peers, S.hyperparameters, S.section, A.section = saved


def _measure(rank: int, layout: str, steps: int) -> dict:
    import meshlab as ml
    from meshlab.core.agree import agree
    from meshlab.train._content import batch_peers, check_replicas, hyperparameters

    model = _model(layout)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-4, check_replicas=0)
    rt = model._meshlab
    g = torch.Generator().manual_seed(rank if layout == "dp" else 0)
    x = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    batch = {"input_ids": x}
    step = lambda: ml.step(model, opt, batch)
    for _ in range(3):
        step()
    out = {}
    # interleaved: the machine's load drifts alike over every variant
    times: dict = {"step_ms": [], "step_no_section_ms": [], "step_bare_ms": []}
    for _ in range(steps):
        times["step_ms"].append(_median_ms(step, 1))
        with _without(digests=False, sections=True):
            times["step_no_section_ms"].append(_median_ms(step, 1))
        with _without(digests=True, sections=True):
            times["step_bare_ms"].append(_median_ms(step, 1))
    out.update({k: statistics.median(v) for k, v in times.items()})
    out["agree_ms"] = _median_ms(lambda: agree(rt.ctrl_group, "bench"), 50)
    peers = lambda: {**batch_peers(rt, batch), **hyperparameters(opt)}
    out["step_agreement_ms"] = _median_ms(
        lambda: agree(rt.ctrl_group, "bench", {"batch": [BATCH, SEQ]}, peers=peers()), 50)
    out["replica_check_ms"] = _median_ms(
        lambda: check_replicas(model, rt.ctrl_group, "bench"), 20)
    out["parameters_per_rank"] = sum(p.to_local().numel() if hasattr(p, "to_local") else
                                     p.numel() for p in model.parameters())
    return out


def _worker(rank: int, port: int, steps: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    res = {layout: _measure(rank, layout, steps) for layout in ("dp", "tp")}
    if rank == 0:
        queue.put(res)
    dist.destroy_process_group()


def main() -> None:
    import _results

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tag", default="vm")
    args = ap.parse_args()
    res = _results.two_ranks(_worker, args.steps)
    from meshlab.train._content import CHECK_EVERY

    for layout, r in res.items():
        bare = r["step_bare_ms"]
        r["overhead_pct"] = round(100 * (r["step_ms"] - bare) / bare, 2)
        r["digests_pct"] = round(100 * (r["step_no_section_ms"] - bare) / bare, 2)
        r["section_pct"] = round(100 * (r["step_ms"] - r["step_no_section_ms"]) / bare, 2)
        r["replica_check_in_steps"] = round(r["replica_check_ms"] / r["step_ms"], 3)
        r["replica_check_pct_at_default"] = round(
            100 * r["replica_check_ms"] / CHECK_EVERY / r["step_ms"], 3)
    worst = max(r["replica_check_in_steps"] for r in res.values())
    out = _results.cpu_run(
        "benchmarks/agreement_cost.py", world=2, backend="gloo", model=CONFIG,
        batch=[BATCH, SEQ], check_every_default=CHECK_EVERY,
        smallest_period_under_1pct=int(100 * worst) + 1, layouts=res)
    path = _results.write_cpu("agreement_cost", args.tag, out)
    print(path)
    for layout, r in res.items():
        print(layout, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
