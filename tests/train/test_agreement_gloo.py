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


# -- contents, not only shapes -------------------------------------------------------------
# Ranks that agree on every shape but hold other contents used to train silently wrong:
# tensor-parallel peers fed other tokens, pipeline stages fed other batches, one rank at
# another learning rate (its replica then drifts from the others in every parameter).
def _content_model(layout: str, world: int):
    import meshlab as ml

    if layout == "tp":                              # dp=2 x tp=2: ranks 0, 1 read one batch
        return ml.parallelize(M.build("llama"), M.spec("tp"), ml.Mesh(dp=2, tp=2), seed=0)
    if layout == "pp":                              # pp=2 x dp=2: ranks 0, 2 read one batch
        spec = ml.pipeline("pp", schedule="1f1b", microbatches=2) | ml.data_parallel("dp")
        return ml.parallelize(M.build("llama", num_hidden_layers=4), spec,
                              ml.Mesh(pp=2, dp=2), seed=0)
    return ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=world), seed=0)


def batch_content_case(rank, world, layout, how):
    """Rank ``odd`` reads a batch of the right shape with other tokens than its peers."""
    import meshlab as ml

    model = _content_model(layout, world)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    odd = {"tp": 1, "pp": 2}[layout]
    coord = model._meshlab.mesh.coordinate(rank).get("dp", 0)
    x = M.batches(1, batch=4, seed=coord + 1)[0]
    if rank == odd:
        x = x.flip(0) if how == "rows" else torch.roll(x, 1, dims=1)
    batch = {"input_ids": x, "labels": x}
    if how == "forward":                    # a plain loop: the forward's own agreement
        first = _outcome(lambda: model(input_ids=x, labels=x).loss.backward())
        model.zero_grad()
    else:
        first = _outcome(lambda: ml.step(model, opt, batch))
    good = M.batches(1, batch=4, seed=coord + 1)[0]
    return first, ml.step(model, opt, {"input_ids": good, "labels": good})


@pytest.mark.parametrize("layout,how", [("tp", "rows"), ("tp", "tokens"), ("pp", "rows"),
                                        ("tp", "forward")])
def test_peers_that_read_one_batch_agree_on_its_contents(world4, layout, how):
    out = world4.run(batch_content_case, layout=layout, how=how)
    odd, peer = {"tp": (1, 0), "pp": (2, 0)}[layout]
    for (kind, msg, secs), after in out:
        assert kind == "RankMismatchError", (kind, msg)
        assert f"ranks [{odd}]" in msg and f"ranks [{peer}]" in msg, msg
        assert "ranks with dp=0" in msg and "same batch" in msg, msg
        assert after > 0                           # still in step: a good step runs


def lr_case(rank, world, layout, plain):
    """Rank 3 steps at another learning rate than the others."""
    import meshlab as ml

    model = _content_model(layout, world)
    lr = 2e-3 if rank == 3 else 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr) if plain else \
        ml.optimizer(model, torch.optim.AdamW, lr=lr)
    x = M.batches(1, batch=4, seed=model._meshlab.mesh.coordinate(rank).get("dp", 0) + 1)[0]
    first = _outcome(lambda: ml.step(model, opt, {"input_ids": x}))
    for g in opt.param_groups:
        g["lr"] = 1e-3
    return first, ml.step(model, opt, {"input_ids": x})


@pytest.mark.parametrize("layout,plain", [("dp", False), ("dp", True), ("tp", False)])
def test_every_rank_steps_with_the_same_hyperparameters(world4, layout, plain):
    out = world4.run(lr_case, layout=layout, plain=plain)
    for (kind, msg, secs), after in out:
        assert kind == "RankMismatchError", (kind, msg)
        assert "param_groups[0]['lr']" in msg and "ranks [3]: 0.002" in msg, msg
        assert after > 0


def booster_lr_case(rank, world):
    """A Booster script whose optimizer has another learning rate on rank 3."""
    import meshlab as ml
    from meshlab.booster import Booster, HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    model = M.build("llama")
    lr = 2e-3 if rank == 3 else 1e-3
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=lr))
    x = M.batches(1, batch=4, seed=model._meshlab.mesh.coordinate(rank).get("dp", 0) + 1)[0]
    booster.backward(model(input_ids=x, labels=x).loss, opt)
    return _outcome(opt.step)


def test_a_booster_script_with_one_rank_at_another_lr_fails_everywhere(world4):
    for kind, msg, secs in world4.run(booster_lr_case):
        assert kind == "RankMismatchError", (kind, msg)
        assert "param_groups[0]['lr']" in msg and "ranks [3]: 0.002" in msg, msg


def replica_case(rank, world, layout, where, tmp):
    """Rank 3 changes one weight of its replica after a step (what a rank at another
    learning rate, or code run on one rank alone, leaves behind)."""
    import meshlab as ml

    model = _content_model(layout, world)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3, check_replicas=2)
    x = M.batches(1, batch=4, seed=model._meshlab.mesh.coordinate(rank).get("dp", 0) + 1)[0]
    ml.step(model, opt, {"input_ids": x})
    name = "model.layers.1.mlp.down_proj.weight"
    if rank == 3:
        with torch.no_grad():
            w = dict(model.named_parameters())[name]
            (w.to_local() if hasattr(w, "to_local") else w)[0, 0] += 1e-3
    if where == "checkpoint":
        return _outcome(lambda: ml.checkpoint.save(f"{tmp}/ckpt", model, opt)), name
    return _outcome(lambda: ml.step(model, opt, {"input_ids": x})), name


@pytest.mark.parametrize("layout,where", [("dp", "step"), ("tp", "step"),
                                          ("dp", "checkpoint")])
def test_replicas_that_drift_apart_fail_at_the_check(world4, layout, where, tmp_path):
    out = world4.run(replica_case, layout=layout, where=where, tmp=str(tmp_path))
    peer = {"dp": "[0, 1, 2]", "tp": "[1]"}[layout]
    for (kind, msg, secs), name in out:
        assert kind is not None and kind.endswith("MismatchError"), (kind, msg)
        assert f"parameter {name}" in msg and "ranks [3]" in msg and peer in msg, msg
        assert "diverged" in msg, msg
    assert not (tmp_path / "ckpt").exists()
