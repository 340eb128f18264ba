"""meshlab's tensor parallelism against DTensor's stock styles, on the same model and layout.

Two gloo processes (tp=2) train a small Llama (hidden 256, 4 layers, 8 query / 4 key-value
heads, vocabulary 4096, batch 8 x 128 tokens) with SGD, the attention projections and the
MLP split as Megatron splits them and the embeddings and head whole, laid out two ways:

* ``meshlab``: ``ml.parallelize(model, ml.shard(policies.auto, rules), Mesh(tp=2))`` with the
  vocabulary replicated, a plain loop (forward, loss, backward, ``optimizer.step``);
* ``stock``: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ``ColwiseParallel`` on q/k/v, gate and up, ``RowwiseParallel`` on o and down, the same
  loop (the model's attention takes ``-1`` heads, so the local head count needs no edit).

Each step (forward, loss, backward, SGD) is timed on rank 0 after warm-up, in ``--rounds``
rounds that alternate the two paths, ``--steps`` steps each: the host overhead of each
path's hooks and DTensor dispatch on a CPU, where the products are small. Both start from
the same weights and see the same batches; their losses are recorded side by side (they
agree to float32 rounding when both are exact). On GPUs the decision compares tokens/s
(eager and compiled); until then the CPU numbers are kept and nothing is moved. Writes
``benchmarks/results/tp_styles_<tag>.json``.

    python benchmarks/tp_styles.py [--steps 20] [--rounds 3] [--tag cpu_gloo]
"""

from __future__ import annotations

import argparse
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
BATCH, SEQ, LR = 8, 128, 1e-2


def _base():
    import transformers

    cfg = transformers.LlamaConfig(**CONFIG)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _meshlab(state):
    import meshlab as ml

    model = _base()
    model.load_state_dict(state)
    rules = ml.Rules(batch=None, heads="tp", kv_heads="tp", mlp="tp", vocab=None, embed=None)
    return ml.parallelize(model, ml.shard(ml.policies.auto, rules), ml.Mesh(tp=2))


def _stock(state, mesh):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    model = _base()
    model.load_state_dict(state)
    plan = {}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}"
        plan.update({f"{p}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj",
                                                                       "v_proj")})
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        plan.update({f"{p}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _step(model, opt, ids):
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return (time.perf_counter() - t) * 1e3, loss.item()


def _worker(rank: int, port: int, steps: int, rounds: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = _base().state_dict()
    models = {"meshlab": _meshlab(state),
              "stock": _stock(state, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in models.items()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
               for _ in range(steps)]
    times = {k: [] for k in models}
    losses = {k: [] for k in models}
    for name in models:                      # warm-up: 3 steps each, not timed
        for ids in batches[:3]:
            _step(models[name], opts[name], ids)
    for r in range(rounds):
        for name in (("meshlab", "stock") if r % 2 == 0 else ("stock", "meshlab")):
            for ids in batches:
                ms, loss = _step(models[name], opts[name], ids)
                times[name].append(ms)
                losses[name].append(loss)
    if rank == 0:
        queue.put({"times_ms": times, "losses_first_round": {k: v[:steps] for k, v in
                                                             losses.items()}})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import _results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default="cpu_gloo")
    args = ap.parse_args()
    got = _results.two_ranks(_worker, args.steps, args.rounds)
    med = {k: statistics.median(v) for k, v in got["times_ms"].items()}
    rounds = {k: [statistics.median(v[i * args.steps:(i + 1) * args.steps])
                  for i in range(args.rounds)] for k, v in got["times_ms"].items()}
    la, lb = got["losses_first_round"]["meshlab"], got["losses_first_round"]["stock"]
    out = _results.cpu_run(
        "benchmarks/tp_styles.py", world=2, config=CONFIG, batch=BATCH, seq=SEQ,
        step_ms_median=med, step_ms_median_per_round=rounds,
        meshlab_over_stock=med["meshlab"] / med["stock"],
        max_loss_difference=max(abs(a - b) for a, b in zip(la, lb)),
        losses_first_round=got["losses_first_round"],
        decision=("waits for the GPU numbers (tokens/s on >= 2 GPUs, eager and compiled): "
                  "meshlab's path stays until then; on the CPU its host overhead per step "
                  f"is {med['meshlab'] / med['stock']:.2f}x the stock styles'"))
    path = _results.write_cpu("tp_styles", args.tag, out)
    print(f"meshlab {med['meshlab']:.1f} ms, stock {med['stock']:.1f} ms per step "
          f"(x{med['meshlab'] / med['stock']:.2f}); per round {rounds}; "
          f"losses apart by at most {out['max_loss_difference']:.1e}; wrote {path}")


if __name__ == "__main__":
    main()
