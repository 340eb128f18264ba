"""step_in_backward() under zero_shard(3) on 2 gloo ranks, against one process.

FSDP2 reduce-scatters each unit's gradients and then calls the sharded parameters'
post-accumulate-grad hooks, so each block is stepped on its shard once its gradients are
summed over the data ranks. Shown here: after each ``backward`` every weight has already
moved and no gradient is left (the update happened in the backward, not at ``opt.step()``);
three steps give the single process's ordinary-step losses and weights in float64, with
SGD and with AdamW; a loss that is not a mean over the data ranks' batches (each rank's
sum) is the one thing that would differ, and the comparison is tight enough to see it."""

from __future__ import annotations

import copy

import pytest
import torch

from tests._world import World

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, TOL = 3, dict(atol=1e-10, rtol=1e-8)
OPTS = {"SGD": (torch.optim.SGD, dict(lr=0.1)),
        "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))}


@pytest.fixture(scope="module")
def world():
    w = World(2)
    yield w
    w.close()


def _base():
    import meshlab as ml
    from meshlab.policies import presets

    return ml.init_weights(presets.build("tiny-llama", num_hidden_layers=3,
                                         dtype=torch.float64), seed=0)


def _ids(step):
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(step))


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _one_process(opt_name):
    import meshlab as ml

    cls, kw = OPTS[opt_name]
    model = _base()
    opt = cls(model.parameters(), **kw)
    losses = []
    for s in range(STEPS):
        ids = _ids(s)
        loss = ml.losses.causal_lm_loss(model(input_ids=ids), {"input_ids": ids})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def case_zero3_steps_in_backward(rank, world, opt_name):
    import torch.distributed as dist

    import meshlab as ml

    cls, kw = OPTS[opt_name]
    model = ml.parallelize(_base(), ml.zero_shard(3, "dp") | ml.step_in_backward(),
                           ml.Mesh(dp=world))
    opt = ml.optimizer(model, cls, **kw)
    params = dict(model.named_parameters())
    losses = []
    for s in range(STEPS):
        ids = _ids(s).chunk(world)[rank]
        before = {n: _full(p.detach()).clone() for n, p in params.items()}
        loss = ml.losses.causal_lm_loss(model(input_ids=ids), {"input_ids": ids})
        loss.backward()
        # the update happened in the backward: every weight moved, no gradient is left
        assert all(p.grad is None for p in params.values()), \
            [n for n, p in params.items() if p.grad is not None]
        moved = [n for n, p in params.items() if not torch.equal(_full(p.detach()), before[n])]
        assert len(moved) == len(params), sorted(set(params) - set(moved))
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / world)
    ref_losses, ref = _one_process(opt_name)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for n, p in params.items():
        torch.testing.assert_close(_full(p.detach()), ref[n], **TOL, msg=n)
    return len(params)


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_zero3_steps_each_unit_in_the_backward_as_one_process(world, opt_name):
    counts = world.run(case_zero3_steps_in_backward, opt_name=opt_name)
    assert counts[0] == counts[1] > 0
