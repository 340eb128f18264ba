"""``step(..., train=False)`` evaluates: the loss of the global batch as one process
computes it (data-parallel ranks averaged, microbatches included), no gradient, no
update; and a wrong ``train`` is refused by name."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(900)


def evaluate_case(rank, world):
    import torch.distributed as dist

    import meshlab as ml

    torch.set_default_dtype(torch.float64)
    try:
        model = ml.parallelize(M.build_staged(), ml.data_parallel("dp"), ml.Mesh(dp=world),
                               seed=0)
        batch = M.padded_batch(seed=11)
        mine = {k: v.chunk(world)[dist.get_rank()] for k, v in batch.items()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        got = ml.step(model, None, mine, M.staged_loss, microbatches=2, train=False)
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        ref = ml.init_weights(M.build_staged(), seed=0)
        with torch.no_grad():
            parts = [{k: v.chunk(2 * world)[i] for k, v in batch.items()}
                     for i in range(2 * world)]
            want = sum(M.staged_loss(ref(**{k: v for k, v in mb.items() if k != "labels"}),
                                     mb) for mb in parts) / len(parts)
        assert got == pytest.approx(want.item(), rel=1e-10)
        try:
            ml.step(model, None, mine, M.staged_loss, train="no")
        except ml.ConfigError as e:
            return str(e)
        return "accepted"
    finally:
        torch.set_default_dtype(torch.float32)


def test_step_evaluates_without_training(world2):
    for msg in world2.run(evaluate_case):
        assert "train" in msg and "'no'" in msg, msg
