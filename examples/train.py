"""Train a small Llama with tensor and data parallelism, top to bottom, in one file.

    meshlab run --nproc-per-node 2 examples/train.py                 # tp=2
    meshlab run --nproc-per-node 4 examples/train.py                 # dp=2 x tp=2
    meshlab run --nproc-per-node 2 examples/train.py --max_steps=20 --zero_stage=0

Every rank runs this file. Each setting below is a plain variable; ``--name=value`` on
the command line overrides it (the value is read as the default's type). The data is the
text corpus meshlab ships, read as bytes, so the vocabulary is 256.
"""

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshlab as ml

# -- configuration ------------------------------------------------------------------------
tp = 2                    # tensor-parallel ranks; the rest of the world is data parallel
zero_stage = 1            # 0: plain data parallel; 1: AdamW state sharded over dp
remat = "selective"       # activation checkpointing of each block: none, selective, full
hidden, layers, heads, kv_heads = 64, 2, 4, 2
seq_len = 64              # tokens (bytes) per sample
batch_size = 8            # the global batch; each dp rank reads batch_size / dp samples
max_steps = 60
lr = 1e-2
log_every = 10
seed = 0
out_dir = "out/train"     # where the checkpoint goes at the end

for arg in sys.argv[1:]:  # --name=value overrides, as nanoGPT's configurator
    name, _, value = arg.removeprefix("--").partition("=")
    if name not in globals() or name.startswith("_") or not value:
        raise SystemExit(f"{arg!r}: expected --name=value with a name set above, "
                         f"such as --max_steps=20")
    try:
        globals()[name] = type(globals()[name])(value)
    except ValueError:
        kind = type(globals()[name]).__name__
        raise SystemExit(f"{arg!r}: {name} takes a value of type {kind}") from None

torch.manual_seed(seed)
torch.set_num_threads(1)  # the ranks share the machine's cores


# -- the model, on the meta device -----------------------------------------------------------
# Nothing is allocated here: parallelize initializes each rank's shards in place (seeded,
# so the result equals one process's model), which is what lets a model larger than one
# device be built at all.
config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                     tie_word_embeddings=False)
with torch.device("meta"):
    model = LlamaForCausalLM(config)


# -- the mesh: named axes over the ranks the launcher started ---------------------------------
world = int(os.environ.get("WORLD_SIZE", "1"))
if world % tp:
    raise SystemExit(f"tp={tp} does not divide the {world} ranks; start a multiple of {tp}")
mesh = ml.Mesh(dp=world // tp, tp=tp)
master = mesh.rank == 0


def say(*args):
    """Print on rank 0 only: every rank holds the same loss."""
    if master:
        print(*args, flush=True)


# -- the spec: how the model is laid out, as a value ----------------------------------------
# Logical axes (heads, mlp, ...) name what a dimension means; the rules map them to mesh
# axes. The Hugging Face policy (policies.auto) says which weight dimension is which.
rules = ml.Rules(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
spec = ml.shard(ml.policies.auto, rules)
if zero_stage:
    spec = spec | ml.zero_shard(stage=zero_stage, axis="dp")
if remat != "none":
    spec = spec | ml.remat(remat)

# The plan is pure: every check runs here, before any weight exists or any rank talks.
plan = ml.plan(model, spec, mesh)
if master:
    print(plan)
    print(plan.memory(batch=batch_size, seq=seq_len))


# -- materialize, then the optimizer ---------------------------------------------------------
model = ml.parallelize(model, spec, mesh, seed=seed)   # the one pass that changes the model
# ml.optimizer is a torch.optim.Optimizer that also shards AdamW's state under ZeRO-1 and
# clips the norm over every axis, so schedulers attach to it as usual.
opt = ml.optimizer(model, torch.optim.AdamW, lr=lr, weight_decay=0.0, clip_grad_norm=1.0)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max_steps, eta_min=lr / 10)


# -- data: dp ranks read distinct windows, tp peers the same ones --------------------------
data = ml.data.TextDataset(seq_len)
# model= gives the loader the plan's data axes (whatever their names).
loader = ml.dataloader(data, mesh, batch_size, model=model, seed=seed)
say(f"{mesh}: {len(data)} windows of {seq_len} bytes, {len(loader)} steps per epoch")


# -- the loop ---------------------------------------------------------------------------
step, epoch = 0, 0
while step < max_steps:
    loader.sampler.set_epoch(epoch)   # a new order each pass over the corpus
    for batch in loader:
        # Forward, backward (gradients reduced as it runs), clipping, the optimizer step.
        # The loss comes back averaged over the dp ranks: the global batch's mean loss.
        loss = ml.step(model, opt, batch)
        sched.step()
        if step % log_every == 0 or step == max_steps - 1:
            say(f"step {step}: loss {loss:.4f}  lr {sched.get_last_lr()[0]:.2e}")
        step += 1
        if step == max_steps:
            break
    epoch += 1


# -- the checkpoint ------------------------------------------------------------------------
# Every rank writes its own shards; the save is atomic, and it loads on another mesh too
# (ml.checkpoint.load reshards).
path = ml.checkpoint.save(os.path.join(out_dir, f"step{step}"), model, opt, sched,
                          extra={"step": step}, dataloader=loader, overwrite=True)
say(f"saved {path}")
torch.distributed.barrier()   # no rank tears the groups down while another still uses them
torch.distributed.destroy_process_group()
