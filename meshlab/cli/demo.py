"""Train the ``tiny-llama`` preset on a bundled text corpus, in parallel, on CPU processes.

Every rank runs this file top to bottom; ``meshlab demo`` starts the ranks for you::

    meshlab demo                                   # 4 processes, mesh dp=2,tp=2
    meshlab demo --mesh dp=4 --zero 3              # ZeRO-3 over 4 data-parallel ranks
    meshlab run --nproc-per-node 4 -m meshlab.cli.demo --mesh dp=2,tp=2 --sp

The mesh axes are ``dp`` (data parallel, split by ``--zero``) and ``tp`` (tensor
parallel). The exit code is 1 when the loss did not fall.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The demo's flags (``meshlab demo`` takes the same ones and passes them on)."""
    ap.add_argument("--mesh", default="dp=2,tp=2", help="axis=size pairs over dp and tp")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch (default 8)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 1e-2)")
    ap.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                    help="ZeRO stage over the dp axis (default 0: plain data parallel)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism over tp")
    ap.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    ap.add_argument("--seed", type=int, default=0, help="initialization and shuffling seed")


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, before any process starts (None: nothing)."""
    from .. import Mesh

    if min(args.steps, args.batch_size, args.log_every) < 1 or args.seq_len < 2:
        return "--steps, --batch-size and --log-every must be >= 1, --seq-len >= 2"
    axes = Mesh.parse(args.mesh).axis_names
    if set(axes) - {"dp", "tp"}:
        return f"--mesh {args.mesh}: the demo's axes are dp (data) and tp (tensor parallel)"
    if args.zero and "dp" not in axes:
        return f"--zero {args.zero} shards over dp, and --mesh {args.mesh} has no dp axis"
    return None


def _train(model, opt, loader, args, say, rank0: bool) -> bool:
    """Steps ``args.steps`` times over the loader (epochs as needed); did the loss fall?"""
    import meshlab as ml
    from tqdm import tqdm

    from ..core.progress import shown

    def batches():
        epoch = 0
        while True:
            loader.sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    # 5. Train.
    losses = []
    # rank 0's, where stderr is a terminal or MESHLAB_PROGRESS=1 asks for it
    bar = tqdm(total=args.steps, disable=not (rank0 and shown()), desc="train")
    t_train = time.perf_counter()
    for i, batch in zip(range(args.steps), batches()):
        loss = ml.step(model, opt, batch)
        losses.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if i % args.log_every == 0 or i == args.steps - 1:
            (bar.write if not bar.disable else say)(
                f"step {i:4d}  loss {loss:.4f}  grad-norm {opt.last_grad_norm:.3f}")
    bar.close()
    elapsed = time.perf_counter() - t_train

    # 6. Did it learn? (The loss is averaged over dp ranks, so every rank agrees.)
    k = max(1, min(5, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    fell = last < first
    say(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} (mean of {k}: {first:.4f} -> "
        f"{last:.4f}); {len(losses) / elapsed:.1f} steps/s")
    say("the loss fell" if fell else "error: the loss did not fall")
    return fell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="meshlab.cli.demo", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    problem = check(args)
    if problem:
        ap.error(problem)
    import torch
    import torch.distributed as dist
    from rich.console import Console
    from tqdm import tqdm

    import meshlab as ml
    from ..policies import presets
    from ..data import TextDataset

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()

    # 1. The mesh: one process per position, started by the launcher.
    mesh = ml.Mesh(ml.Mesh.parse(args.mesh).shape)
    rank0 = mesh.rank == 0
    say = print if rank0 else (lambda *a, **k: None)

    # 2. The model (on the meta device: no memory yet) and how to lay it out.
    model = presets.build("tiny-llama")
    # Each logical axis on the mesh axis of that name, replicated where the mesh lacks it.
    rules = ml.Rules(batch=("dp", None), heads=("tp", None), kv_heads=("tp", None),
                     mlp=("tp", None), vocab=("tp", None), embed=None)
    if args.sp:
        rules = rules | ml.Rules(seq="tp")
    spec = ml.shard(ml.policies.auto, rules)
    if args.zero:
        spec = spec | ml.zero_shard(args.zero, "dp")
    plan = ml.plan(model, spec, mesh)
    if rank0:
        console = Console(width=None if sys.stdout.isatty() else 160)
        console.print(plan)
        console.print(plan.memory())

    # 3. Materialize: each rank initializes only its own shards.
    model = ml.parallelize(model, spec, mesh, seed=args.seed)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=0.0,
                       clip_grad_norm=1.0)

    # 4. Data: every dp rank reads distinct windows; tp peers read the same ones.
    data = TextDataset(args.seq_len)
    loader = ml.dataloader(data, mesh, args.batch_size, model=model, seed=args.seed)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise ml.ConfigError(f"--batch-size {args.batch_size} is larger than the "
                             f"{len(data)} windows of the corpus")
    say(f"{mesh}: {len(data)} windows of {args.seq_len} bytes, global batch "
        f"{args.batch_size}, {steps_per_epoch} steps per epoch, {args.steps} steps")

    fell = _train(model, opt, loader, args, say, rank0)
    say(f"{time.perf_counter() - t0:.1f} s in all")
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()
    return 0 if fell else 1


if __name__ == "__main__":
    import os

    from ..core.errors import MeshlabError

    try:
        sys.exit(main())
    except MeshlabError as e:  # the same on every rank: say it once
        if os.environ.get("RANK", "0") == "0":
            print(f"meshlab.cli.demo: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
