"""Buffers a training forward changes, where the step cuts the batch (``train/_buffers``).

A module of the user's own that keeps a running mean of its input in a buffer trained,
under data parallelism, with each rank's mean of its own share: the replicas' buffers
differed from each other and from the single process's, and so did every later output,
without an error. Cut into microbatches, the buffer was updated once per microbatch. On
the first step that cuts the batch, every rank now stops with an error naming the buffer,
before the step's first backward (the weights are as they were); a buffer every rank
updates alike and once a step (as transformers' dynamic rotary frequencies follow the
sequence length) trains as before.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(300)


class RunningMean(nn.Module):
    """Subtracts a running mean of its input, updated in the training forward."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n, dtype=torch.float64))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.mean


class SeenLength(nn.Module):
    """Keeps the last batch's feature count: the same on every rank and microbatch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("width", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.width.fill_(x.shape[-1])
        return x


def _loss(out, batch):
    return ((out - batch["y"]) ** 2).mean()


def case(rank, world, module, split, microbatches):
    import meshlab as ml

    torch.manual_seed(0)
    made = {"running_mean": lambda: RunningMean(4), "seen_length": SeenLength}[module]()
    net = nn.Sequential(nn.Linear(4, 4), made, nn.Linear(4, 1)).double()
    model = ml.parallelize(net, ml.data_parallel("dp"), ml.Mesh(dp=world))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    # ``split``: each rank its share of the batch; else every rank the same whole batch
    batch = {"x": x.chunk(world)[rank], "y": y.chunk(world)[rank]} if split else \
        {"x": x, "y": y}
    try:
        for _ in range(2):
            ml.step(model, opt, batch, _loss, inputs=["x"], microbatches=microbatches)
    except ml.MeshlabError as e:
        unchanged = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
        return type(e).__name__, str(e), unchanged
    return "trained", None, None


def test_a_buffer_each_rank_updates_from_its_share_is_refused(world2):
    for kind, msg, unchanged in world2.run(case, module="running_mean", split=True,
                                           microbatches=1):
        assert kind == "RankMismatchError", (kind, msg)
        assert "buffer 1.mean differs among ranks" in msg and "whole batch" in msg, msg
        assert unchanged


def test_a_buffer_updated_once_per_microbatch_is_refused(world2):
    # the same whole batch on both ranks: the replicas agree, the microbatches do not
    for kind, msg, unchanged in world2.run(case, module="running_mean", split=False,
                                           microbatches=2):
        assert kind == "ConfigError", (kind, msg)
        assert "buffer '1.mean' changed again in the second microbatch's forward" in msg, msg
        assert unchanged


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_buffer_every_rank_updates_alike_trains(world2, microbatches):
    for kind, msg, _ in world2.run(case, module="seen_length", split=True,
                                   microbatches=microbatches):
        assert kind == "trained", msg
