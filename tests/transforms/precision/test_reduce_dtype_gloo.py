"""``precision(reduce=...)`` beside ``data_parallel`` and ``zero_shard(1)``: the gradients
cross the data axis in the narrow dtype (half the bytes of float32, as ``plan.comm()``
counts them), and training matches one process under the same autocast at that dtype's
tolerance (``tests/transforms/test_table_parity.py`` trains each cell; this holds the bytes
and the dtype the collectives carry)."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M
from tests._world import World

pytestmark = [pytest.mark.timeout(300)]


def _spec(room: str, reduce: str | None):
    import meshlab as ml

    data = ml.data_parallel("dp") if room == "dp" else ml.zero_shard(1, "dp")
    if reduce is None:
        return data | ml.precision("bf16")
    return data | ml.precision("bf16" if reduce == "bf16" else "fp16", reduce=reduce,
                               loss_scale=None)


def reduce_case(rank, world, room, reduce):
    import meshlab as ml
    from meshlab.estimate.comm import CommCounter

    kind = "all_reduce" if room == "dp" else "reduce_scatter"
    model = ml.parallelize(M.build("llama"), _spec(room, reduce), ml.Mesh(dp=2), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(rank))
    ml.step(model, opt, {"input_ids": ids})
    with CommCounter(per_module=False) as cc:
        ml.step(model, opt, {"input_ids": ids})
    got = sum(b for k, _, b in cc.calls if k == kind and b > 8)      # not the loss's 8 bytes
    est = ml.plan(M.build("llama"), _spec(room, reduce), ml.Mesh(dp=2, fake=True)).comm(
        batch=2, seq=8)
    want = est.bytes(kind) - (8 if kind == "all_reduce" else 0)
    return got, want


@pytest.fixture(scope="module")
def world2():
    w = World(2)
    yield w
    w.close()


@pytest.mark.parametrize("room", ["dp", "zero1"])
def test_gradients_cross_in_the_reduce_dtype(world2, room):
    """The same gradients in half float32's bytes: the collectives carry 2-byte elements."""
    wide, wide_est = world2.run(reduce_case, room=room, reduce=None)[0]
    assert wide == wide_est and wide > 0
    for reduce in ("bf16", "fp16"):
        got, want = world2.run(reduce_case, room=room, reduce=reduce)[0]
        assert got == want, (reduce, got, want)
        assert 0.45 < got / wide < 0.55, (reduce, got, wide)
