"""float8 against bf16 over a training run: the Llama-3-8B shape of ``single_gpu.py``
trained ``--steps`` steps by ``precision('fp8')`` (fused ops, 19 blocks checkpointed,
compiled blocks) and by the best bf16 layout (fused ops, 19 blocks checkpointed, the
optimizer stepping in the backward), on the same batches (fresh random ids each step
from one seed) from the same weights; the mean loss of the last ``--window`` steps of
each, and their ratio. Writes ``benchmarks/results/fp8_loss_<card>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
import single_gpu  # noqa: E402

ROWS = ("meshlab_count19_blocks_fp8", "meshlab_count19_sib")


def train(name: str, base, shape: dict, steps: int) -> list[float]:
    import meshlab as ml
    from meshlab.ops import FusedAdamW

    model = ml.parallelize(base, single_gpu._meshlab_spec(name), ml.Mesh(dp=1))
    opt = ml.optimizer(model, FusedAdamW, lr=1e-5)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, base.config.vocab_size, (shape["batch"], shape["seq"]),
                            device="cuda", generator=g)
        losses.append(float(ml.step(model, opt, {"input_ids": ids})))
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    shape = dict(single_gpu.SHAPES["llama3-8b"])
    base, _ = single_gpu.build(shape)
    base = base.cpu()                    # the starting weights; one model on the device
    runs = {}
    for name in ROWS:
        runs[name] = train(name, copy.deepcopy(base).cuda(), shape, args.steps)
        tail = statistics.mean(runs[name][-args.window:])
        print(f"{name}: first {runs[name][0]:.4f}, mean of the last {args.window} {tail:.4f}",
              flush=True)
    tails = {k: statistics.mean(v[-args.window:]) for k, v in runs.items()}
    ratio = tails[ROWS[0]] / tails[ROWS[1]]
    print(f"fp8 / bf16 mean loss of the last {args.window} steps: {ratio:.4f}")
    dev = torch.cuda.get_device_properties(0)
    out = {"card": dev.name, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shape": "llama3-8b", "steps": args.steps, "window": args.window,
           "data": "fresh random ids each step from torch.Generator seed 1, the same for both",
           "mean_loss_last_window": tails, "ratio_fp8_over_bf16": ratio, "losses": runs}
    print(f"wrote {_results.write('fp8_loss', dev.name, out, args.copy_to)}")


if __name__ == "__main__":
    main()
