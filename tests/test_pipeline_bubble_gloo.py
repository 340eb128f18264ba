"""The idle fraction of a pipeline, measured on 4 gloo processes, against the plan's
formula. Each block's work is made a known cost (forward sleeps F, backward 2F, as the
formulas assume) so the measurement tests the schedule, not two shared CPU cores."""

from __future__ import annotations

import time

import pytest
import torch

from . import _models as M
from ._world import World

pytestmark = pytest.mark.timeout(600)
F = 0.05          # seconds of forward work per block and microbatch


class _Work(torch.autograd.Function):
    busy = [0.0]

    @staticmethod
    def forward(ctx, x):
        t = time.perf_counter()
        time.sleep(F)
        _Work.busy[0] += time.perf_counter() - t
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        t = time.perf_counter()
        time.sleep(2 * F)
        _Work.busy[0] += time.perf_counter() - t
        return g


def bubble_case(rank, world, schedule):
    import meshlab as ml
    from meshlab.parallel.pipeline import bubble
    from meshlab.parallel.pipeline._runtime import PipelinePart

    spec = ml.pipeline("pp", schedule=schedule, microbatches=8)
    mesh = ml.Mesh(pp=4)
    model = ml.parallelize(M.build("llama", num_hidden_layers=8), spec, mesh, seed=0)
    for b in model._meshlab.part(PipelinePart).kept:
        blk = dict(model.named_modules())[b]
        blk.register_forward_hook(
            lambda m, a, out: (_Work.apply(out[0]),) + tuple(out[1:]) if isinstance(out, tuple)
            else _Work.apply(out))
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.0)
    batch = {"input_ids": torch.randint(0, 97, (8, 8))}
    ml.step(model, opt, batch)                       # warm-up: shapes are exchanged once
    _Work.busy[0] = 0.0
    t = time.perf_counter()
    ml.step(model, opt, batch)
    total = time.perf_counter() - t
    expected = bubble(ml.plan(M.build("llama", num_hidden_layers=8), spec, mesh))
    return 1 - _Work.busy[0] / total, expected


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_measured_bubble_matches_the_plan(schedule):
    w = World(4)
    try:
        out = w.run(bubble_case, schedule=schedule)
    finally:
        w.close()
    expected = out[0][1]
    idle = [o[0] for o in out]
    print(f"{schedule}: expected {expected:.3f}, measured per rank {[round(x, 3) for x in idle]}")
    for x in idle:
        assert abs(x - expected) <= 0.05, (schedule, idle, expected)
