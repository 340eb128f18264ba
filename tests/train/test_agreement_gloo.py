"""Ranks that disagree fail fast, on every rank, with one typed error (4 gloo processes).

Before the first collective of ``parallelize`` and of every ``step``, the ranks exchange a
fingerprint of what they run (``meshlab.core.agree``); a rank that differs, or that fails a
check alone, makes every rank raise ``RankMismatchError`` / ``PeerError`` naming the
ranks and the field, instead of hanging in gloo or training on mismatched peers.
Each case must finish well within the world's 90 s collective timeout.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(300)


def _outcome(fn):
    import meshlab as ml

    t0 = time.monotonic()
    try:
        fn()
    except ml.MeshlabError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _spec_for(rank: int, case: str):
    import meshlab as ml

    odd = rank == 3
    if case == "zero":
        return ml.zero_shard(3 if odd else 1, "dp"), ml.Mesh(dp=4), {}
    if case == "remat":
        return ml.data_parallel("dp") | (ml.remat("full") if odd else ml.remat("selective")), \
            ml.Mesh(dp=4), {}
    if case == "precision":
        return ml.data_parallel("dp") | ml.precision("bf16" if odd else "fp32"), ml.Mesh(dp=4), {}
    if case == "axis order":
        mesh = ml.Mesh(tp=2, dp=2) if odd else ml.Mesh(dp=2, tp=2)
        return M.spec("tp"), mesh, {}
    if case == "config":
        return ml.data_parallel("dp"), ml.Mesh(dp=4), dict(num_hidden_layers=3 if odd else 2)
    if case == "rules typo":      # a typed error on rank 3 alone, in plan
        rules = ml.Rules(**{**M.TP_RULES, "mlp": "model" if odd else "tp"})
        return ml.shard(ml.policies.auto, rules), ml.Mesh(dp=2, tp=2), {}
    raise KeyError(case)


def parallelize_case(rank, world, case):
    import meshlab as ml

    spec, mesh, over = _spec_for(rank, case)
    return _outcome(lambda: ml.parallelize(M.build("llama", **over), spec, mesh, seed=0))


@pytest.mark.parametrize("case,field", [("zero", "spec"), ("remat", "spec"),
                                        ("precision", "spec"), ("axis order", "mesh"),
                                        ("config", "config")])
def test_parallelize_agrees_before_any_collective(world4, case, field):
    out = world4.run(parallelize_case, case=case)
    for kind, msg, secs in out:
        assert kind == "RankMismatchError", out
        assert f"disagree on {field}" in msg and "ranks [3]" in msg, msg
        assert secs < 30, secs


def test_an_error_on_one_rank_is_raised_on_every_rank(world4):
    out = world4.run(parallelize_case, case="rules typo")
    assert out[3][0] == "RulesError" and "model" in out[3][1], out[3]
    for kind, msg, secs in out[:3]:
        assert kind == "PeerError" and "rank 3" in msg and "RulesError" in msg, msg
        assert secs < 30


def step_case(rank, world, what):
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=world), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b, s = 2, 8
    if rank == 1:
        b, s = (b, s + 4) if what == "seq" else (b + 1, s)
    x = torch.randint(0, 97, (b, s))
    first = _outcome(lambda: ml.step(model, opt, {"input_ids": x}))
    # after a refused step the ranks are still in step with each other: a good one runs
    loss = ml.step(model, opt, {"input_ids": torch.randint(0, 97, (2, 8))})
    return first, loss


@pytest.mark.parametrize("what", ["seq", "batch"])
def test_step_agrees_on_batch_shapes(world4, what):
    out = world4.run(step_case, what=what)
    for (kind, msg, secs), loss in out:
        assert kind == "RankMismatchError" and "batch" in msg and "ranks [1]" in msg, msg
        assert loss > 0


def save_while_stepping_case(rank, world, tmp):
    """Rank 3's data ran out: it saves while the others still step."""
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=world), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 97, (2, 8))
    if rank == 3:
        return _outcome(lambda: ml.checkpoint.save(f"{tmp}/ckpt", model, opt))
    return _outcome(lambda: ml.step(model, opt, {"input_ids": x}))


def test_a_rank_saving_while_others_step_fails_everywhere(world4, tmp_path):
    out = world4.run(save_while_stepping_case, tmp=str(tmp_path))
    for kind, msg, secs in out:
        # (CheckpointMismatchError on the saving rank: a RankMismatchError and a
        # CheckpointError both)
        assert kind.endswith("MismatchError") and "different collective calls" in msg, out
        assert "ranks [3] in checkpoint.save" in msg, msg
        assert secs < 30
    assert not (tmp_path / "ckpt").exists()
