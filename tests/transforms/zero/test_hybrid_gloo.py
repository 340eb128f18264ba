"""Hybrid sharding: ``data_parallel('rep') | zero_shard(stage, 'dp')`` on ``Mesh(rep=2, dp=2)``.

The two make one value, ``zero_shard(stage, 'dp', replicate='rep')``: the batch is split
over both axes, the state replicated over ``rep`` and sharded over ``dp`` (FSDP2 on the 2-D
mesh ``(rep, dp)`` for stages 2 and 3; for stage 1 the backward's all-reduce over ``rep``,
then ZeRO-1's reduce-scatter over ``dp``).

* The plan: one room taking both rows; memory per rank that of ``zero_shard`` over ``dp``
  alone; traffic with an all-reduce over ``rep``; a typed refusal naming the fix for the
  same axis in both, a mesh with the replicate axis after the shard axis (FSDP2 slices the
  2-D mesh in mesh order), a spec that shards over the replicate axis, and (not yet) one
  that shards over the shard axis itself (FSDP by spec).
* ZeRO-3 on 4 gloo ranks trains a small Llama as one process does on the whole batch
  (float64, SGD): every step's loss and the final weights to 1e-10; every parameter is a
  DTensor on the mesh ``(rep, dp)``, Replicate over rep and Shard(0) over dp.
* The collectives of one step of each stage, counted with ``CommCounter``, equal
  ``plan.comm()``. (The table's parity cases train stages 1, 2 and 3 against one process:
  ``tests/transforms/test_table_parity.py -k data_parallel-zero``.)
"""

from __future__ import annotations

import json

import pytest
import torch

import meshlab as ml
from tests import _models as M

pytestmark = pytest.mark.timeout(600)

MESH = dict(rep=2, dp=2)


def _hybrid(stage: int):
    return ml.data_parallel("rep") | ml.zero_shard(stage, "dp")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_room_over_both_data_axes(stage):
    for spec in (_hybrid(stage), ml.zero_shard(stage, "dp") | ml.data_parallel("rep"),
                 ml.zero_shard(stage, "dp", replicate="rep")):
        p = ml.plan(M.build("llama"), spec, ml.Mesh(**MESH, fake=True))
        assert p.runnable and p.options == (ml.zero_shard(stage, "dp", replicate="rep"),)
        assert repr(p.options[0]) == f"zero_shard(stage={stage}, axis='dp', replicate='rep')"
        assert p.roles.dp == ("rep", "dp")
        assert p.options[0].rows(p) == ("data_parallel", f"zero_shard({stage})")
        back = ml.Plan.from_json(json.loads(json.dumps(p.to_json())))
        assert back.options == p.options


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_is_the_shard_axis_and_traffic_adds_the_replicas(stage):
    hybrid = ml.plan(M.build("llama"), _hybrid(stage), ml.Mesh(**MESH, fake=True))
    alone = ml.plan(M.build("llama"), ml.zero_shard(stage, "dp"), ml.Mesh(dp=2, fake=True))
    assert hybrid.memory().by_category == alone.memory().by_category
    h, a = hybrid.comm(), alone.comm()
    for kind in ("all_gather", "reduce_scatter"):      # ZeRO's own, over dp only
        assert h.count(kind, "dp") == a.count(kind, "dp") > 0
        assert h.bytes(kind, "dp") == a.bytes(kind, "dp")
    # the step's loss; under FSDP2 also one count per parameter (which had a gradient)
    n = sum(1 for e in hybrid if e.tied_to is None)
    assert h.count("all_reduce", "rep_dp") == (1 if stage == 1 else 2)
    assert h.bytes("all_reduce", "rep_dp") == 8 + (0 if stage == 1 else 4 * n)
    if stage == 1:
        # the backward's all-reduce of every gradient (and one flag per parameter) over rep
        psi = sum(e.numel for e in hybrid if e.tied_to is None) * 4
        assert h.bytes("all_reduce", "rep") == psi + 4 * n
    else:
        # FSDP2's all-reduce of each unit's reduce-scattered shard: half the reduce-scatter
        assert h.count("all_reduce", "rep") == h.count("reduce_scatter", "dp")
        assert h.bytes("all_reduce", "rep") * 2 == h.bytes("reduce_scatter", "dp")


def test_what_is_refused_names_the_fix():
    with pytest.raises(ml.ConfigError) as e:
        ml.data_parallel("dp") | ml.zero_shard(3, "dp")
    assert str(e.value) == (
        "data_parallel('dp') and zero_shard(stage=3, axis='dp'): axis 'dp' would both "
        "replicate and shard the same state; keep zero_shard(3, 'dp') alone, or give the "
        "replicas an axis of their own for hybrid sharding, e.g. Mesh(rep=2, dp=2) with "
        "data_parallel('rep') | zero_shard(3, 'dp')")
    with pytest.raises(ml.ConfigError, match=r"build it as Mesh\(rep=2, dp=2\)"):
        ml.plan(M.build("llama"), _hybrid(3), ml.Mesh(dp=2, rep=2, fake=True))
    # ZeRO-1 runs its two reductions on groups of their own: any mesh order
    assert ml.plan(M.build("llama"), _hybrid(1), ml.Mesh(dp=2, rep=2, fake=True)).runnable
    with pytest.raises(ml.ConfigError, match=r"use data_parallel\(\('rep', 'dp'\)\)"):
        ml.zero_shard(0, "dp", replicate="rep")
    with pytest.raises(ml.ConfigError, match="two zero transforms in one spec"):
        _hybrid(3) | ml.data_parallel("x")
    with pytest.raises(ml.ConfigError, match="zero_shard\\(1\\) x zero_shard\\(3\\): meaningless"):
        ml.data_parallel("rep") | ml.zero_shard(1, "dp") | ml.zero_shard(3, "x")
    with pytest.raises(ml.ConfigError, match="the axes zero_shard.* replicates it on"):
        ml.plan(M.build("llama"), ml.shard(ml.policies.auto, ml.Rules(embed="rep"))
                | _hybrid(3), ml.Mesh(**MESH, fake=True))
    with pytest.raises(ml.ConfigError, match="beside the replicate axes .* not yet supported"):
        ml.plan(M.build("llama"), ml.shard(ml.policies.auto, ml.Rules(embed="dp"))
                | _hybrid(3), ml.Mesh(**MESH, fake=True))


STEPS, LR, TOL = 3, 0.1, 1e-10


def zero3_case(rank, world):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.set_default_dtype(torch.float64)
    try:
        data = M.batches(STEPS, batch=4, seq=8)
        loss_fn = M.loss_fn("llama")
        ref = ml.init_weights(M.build("llama"), seed=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        ref_losses = []
        for b in data:
            loss = loss_fn(ref(input_ids=b), {"input_ids": b})
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())

        model = ml.parallelize(M.build("llama"), _hybrid(3), ml.Mesh(**MESH), seed=0)
        placements = {}
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor), n
            assert p.device_mesh.mesh_dim_names == ("rep", "dp"), (n, p.device_mesh)
            assert p.placements == (Replicate(), Shard(0)), (n, p.placements)
            placements[n] = str(p.placements)
        opt = ml.optimizer(model, torch.optim.SGD, lr=LR)
        rt = model._meshlab
        assert rt.dp_size == 4
        dp_rank = dist.get_rank(rt.dp_group)
        losses = [ml.step(model, opt, {"input_ids": b.chunk(4)[dp_rank]}, loss_fn) for b in data]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
        refp = dict(ref.named_parameters())
        worst = 0.0
        for n, p in model.named_parameters():
            w = M.full(p).detach()
            torch.testing.assert_close(w, refp[n].detach(), atol=TOL, rtol=0,
                                       msg=lambda m, n=n: f"weight {n}: {m}")
            worst = max(worst, (w - refp[n]).abs().max().item())
        moved = max((w - ref_start).abs().max().item() for w, ref_start in zip(
            (M.full(p).detach() for p in model.parameters()),
            (q.detach() for q in ml.init_weights(M.build("llama"), seed=0).parameters())))
        return {"losses": losses, "worst": worst, "moved": moved, "placements": placements}
    finally:
        torch.set_default_dtype(torch.float32)


def test_zero3_over_dp_replicated_over_rep_trains_as_one_process(world4):
    out = world4.run(zero3_case)
    assert all(o["losses"] == out[0]["losses"] for o in out)
    assert out[0]["worst"] <= TOL
    assert out[0]["moved"] > 1e-3          # the steps changed the weights
    assert len(out[0]["placements"]) == len(list(M.build("llama").parameters()))


def comm_case(rank, world, stage):
    import torch.distributed as dist

    from meshlab.estimate.comm import CommCounter

    mesh = ml.Mesh(**MESH)
    plan = ml.plan(M.build("llama"), _hybrid(stage), mesh)
    model = ml.parallelize(M.build("llama"), _hybrid(stage), mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group)
    data = M.batches(2, batch=4, seq=8)
    loss_fn = M.loss_fn("llama")
    ml.step(model, opt, {"input_ids": data[0].chunk(4)[dp_rank]}, loss_fn)   # FSDP's lazy init
    with CommCounter() as cc:
        ml.step(model, opt, {"input_ids": data[1].chunk(4)[dp_rank]}, loss_fn)
    est = plan.comm(batch=1, seq=8, coord=mesh.coordinate(rank))
    got = {k: (cc.count(k), cc.bytes(k)) for k in ("all_reduce", "all_gather", "reduce_scatter")}
    want = {k: (est.count(k), est.bytes(k)) for k in got}
    assert got == want, (stage, got, want)
    return got


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collectives_match_the_plan(world4, stage):
    out = world4.run(comm_case, stage=stage)
    assert all(o == out[0] for o in out)
