"""float8 against bf16 over a training run: the Llama-3-8B shape of ``single_gpu.py``
trained ``--steps`` steps by ``precision('fp8')`` (fused ops, 19 blocks checkpointed,
compiled blocks) and by the best bf16 layout (fused ops, 19 blocks checkpointed, the
optimizer stepping in the backward), on the same batches from the same weights; the mean
loss of the last ``--window`` steps of each, and their ratio.

The batches (``--data bigram``, the default) are fresh samples each step of one fixed
random chain: each of 8,192 tokens is followed by one of 4 others chosen at random, so
there is something to learn and the loss has a floor (the chain's entropy, at most
ln 4 = 1.386 nats), and a precision that learns worse shows as a gap between the runs.
``--data random`` draws every token uniformly (nothing to learn: both runs stay at
ln(vocab)). ``--rows`` runs some rows only (one device call each) and ``--merge`` joins
their JSON files. Writes ``benchmarks/results/fp8_loss_<card>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
import single_gpu  # noqa: E402

ROWS = ("meshlab_count19_blocks_fp8", "meshlab_count19_sib")


BIGRAM = dict(tokens=8192, branch=4, seed=1)


def bigram_batches(steps: int, batch: int, seq: int, tokens: int = 8192, branch: int = 4,
                   seed: int = 1) -> torch.Tensor:
    """(steps, batch, seq) token ids sampled from a fixed random chain over ``tokens``
    ids, each followed by one of ``branch`` successors (uniformly), all from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, tokens, (tokens, branch), generator=g)
    n = steps * batch
    cur = torch.randint(0, tokens, (n,), generator=g)
    pick = torch.randint(0, branch, (n, seq), generator=g)
    out = torch.empty(n, seq, dtype=torch.long)
    for t in range(seq):
        out[:, t] = cur
        cur = table[cur, pick[:, t]]
    return out.view(steps, batch, seq)


def floor_nats(tokens: int = 8192, branch: int = 4, seed: int = 1) -> float:
    """The chain's entropy rate: the mean over tokens of the entropy of its successors (a
    repeated successor counts twice), under the uniform start (the chain's stationary
    distribution is close to it)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, tokens, (tokens, branch), generator=g)
    ent = 0.0
    for row in table.tolist():
        counts = [row.count(x) / branch for x in set(row)]
        ent -= sum(p * math.log(p) for p in counts)
    return ent / tokens


def train(name: str, base, shape: dict, steps: int, data: str, lr: float) -> list[float]:
    import meshlab as ml
    from meshlab.ops import FusedAdamW

    model = ml.parallelize(base, single_gpu._meshlab_spec(name), ml.Mesh(dp=1))
    opt = ml.optimizer(model, FusedAdamW, lr=lr)
    if data == "bigram":
        batches = bigram_batches(steps, shape["batch"], shape["seq"], **BIGRAM)
        ids_of = lambda i: batches[i].cuda()                      # noqa: E731
    else:
        g = torch.Generator(device="cuda").manual_seed(1)
        ids_of = lambda i: torch.randint(0, base.config.vocab_size,  # noqa: E731
                                         (shape["batch"], shape["seq"]), device="cuda",
                                         generator=g)
    losses = []
    for i in range(steps):
        losses.append(float(ml.step(model, opt, {"input_ids": ids_of(i)})))
        if i % 25 == 0 or i == steps - 1:
            print(f"{name} step {i} loss {losses[-1]:.4f}", flush=True)
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return losses


def _summary(runs: dict, window: int) -> dict:
    tails = {k: statistics.mean(v[-window:]) for k, v in runs.items()}
    ratio = tails[ROWS[0]] / tails[ROWS[1]] if all(r in tails for r in ROWS) else None
    return {"mean_loss_last_window": tails, "ratio_fp8_over_bf16": ratio}


def merge(paths: list[str], copy_to: str | None) -> None:
    """Join the JSON of runs made one row at a time (same card, steps, data)."""
    import json

    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for k in ("card", "steps", "window", "data", "lr"):
        if any(p[k] != first[k] for p in parts):
            raise SystemExit(f"--merge: the files differ in {k}")
    runs = {k: v for p in parts for k, v in p["losses"].items()}
    out = {**first, "runs_dates": [p["date"] for p in parts], "losses": runs,
           **_summary(runs, first["window"])}
    print(f"fp8 / bf16 mean loss of the last {first['window']} steps: "
          f"{out['ratio_fp8_over_bf16']}")
    print(f"wrote {_results.write('fp8_loss', first['card'], out, copy_to)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--data", choices=("bigram", "random"), default="bigram")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    ap.add_argument("--tag", default="", help="appended to the JSON's name")
    ap.add_argument("--merge", nargs="+", default=None, help="JSON files of single rows")
    ap.add_argument("--copy-to", default=None)
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.copy_to)
    rows = [r for r in args.rows.split(",") if r]
    shape = dict(single_gpu.SHAPES["llama3-8b"])
    base, _ = single_gpu.build(shape)
    base = base.cpu()                    # the starting weights; one model on the device
    runs = {}
    for name in rows:
        runs[name] = train(name, copy.deepcopy(base).cuda() if len(rows) > 1 else base.cuda(),
                           shape, args.steps, args.data, args.lr)
        tail = statistics.mean(runs[name][-args.window:])
        print(f"{name}: first {runs[name][0]:.4f}, mean of the last {args.window} {tail:.4f}",
              flush=True)
    dev = torch.cuda.get_device_properties(0)
    data = (f"bigram chain: {BIGRAM['tokens']} tokens, each followed by one of "
            f"{BIGRAM['branch']} (seed {BIGRAM['seed']}), fresh samples each step; entropy "
            f"floor {floor_nats(**BIGRAM):.4f} nats" if args.data == "bigram" else
            "fresh random ids each step from torch.Generator seed 1, the same for both")
    out = {"card": dev.name, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "shape": "llama3-8b", "steps": args.steps, "window": args.window, "lr": args.lr,
           "optimizer": "meshlab FusedAdamW", "data": data, "losses": runs,
           **_summary(runs, args.window)}
    print(f"wrote {_results.write('fp8_loss' + (('_' + args.tag) if args.tag else ''), dev.name, out, args.copy_to)}")


if __name__ == "__main__":
    main()
