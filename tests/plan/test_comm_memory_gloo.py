"""Collectives, memory, loss scaling and bad input on real gloo processes (world 4).

* Collectives of one training step, counted with CommDebugMode (``CommCounter`` adds the
  bytes), equal ``plan.comm()``: the formulas are in ``meshlab/estimate/comm.py`` (DP and ZeRO-1/2:
  2Ψ; ZeRO-3: ≈3Ψ; TP: 2L + 1 all-reduces of the activations each way, plus the loss).
  Under a pipeline (pp=2 x tp=2) each rank's sends, receives and TP all-reduces equal the
  plan's at its coordinate: its own blocks, per microbatch.
* The bytes of parameters, gradients and optimizer state each rank holds at the optimizer
  step are within 15% of ``plan.memory()``.
* fp16 with an overflow on one rank: every rank skips, weights stay, the scale halves.
* Bad input raises the same typed error on every rank before any collective of the model
  runs (the ranks' fingerprint agreement, counted as "control", is the only exchange).
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(600)
B, S = 4, 8


def _run_step(model, opt, rank_batch, family="llama"):
    import meshlab as ml

    return ml.step(model, opt, {"input_ids": rank_batch}, M.loss_fn(family))


def comm_case(rank, world, spec_name):
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.estimate.comm import CommCounter

    mesh = M.mesh_for(spec_name, world)
    plan = ml.plan(M.build("llama"), M.spec(spec_name), mesh)
    model = ml.parallelize(M.build("llama"), M.spec(spec_name), mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    data = M.batches(2, batch=B, seq=S)
    _run_step(model, opt, data[0].chunk(rt.dp_size)[dp_rank])   # warm-up (lazy FSDP init)
    with CommCounter() as cc:
        _run_step(model, opt, data[1].chunk(rt.dp_size)[dp_rank])
    est = plan.comm(batch=B // rt.dp_size, seq=S, coord=mesh.coordinate(rank))
    got = {k: (cc.count(k), cc.bytes(k)) for k in ("all_reduce", "all_gather", "reduce_scatter")}
    want = {k: (est.count(k), est.bytes(k)) for k in got}
    assert got == want, (spec_name, got, want)
    return got


@pytest.mark.parametrize("spec_name", ["dp", "zero1", "zero2", "zero3", "tp", "tp_sp"])
def test_collectives_match_the_plan(world4, spec_name):
    out = world4.run(comm_case, spec_name=spec_name)
    assert all(o[k][0] == out[0][k][0] for o in out for k in o)   # same counts everywhere
    psi = None
    if spec_name in ("dp", "zero1", "zero2", "zero3"):
        # Ψ: fp32 gradient bytes of the whole tiny llama (every rank holds all of it).
        import meshlab as ml

        p = ml.plan(M.build("llama"), None, ml.Mesh(dp=4, fake=True))
        psi = sum(e.numel for e in p if e.tied_to is None) * 4
        ar, ag, rs = (out[0][k][1] for k in ("all_reduce", "all_gather", "reduce_scatter"))
        moved = 2 * ar + ag + rs        # an all-reduce is a reduce-scatter plus an all-gather
        expected = {"dp": 2, "zero1": 2, "zero2": 2, "zero3": 3}[spec_name]
        # Padding every parameter's first dim to a multiple of dp adds a few elements.
        assert expected * psi <= moved - 16 <= expected * psi * 1.02, (moved, psi)


PP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv")


def pp_comm_case(rank, world, schedule):
    """pp=2 x tp=2, four blocks: each rank's counted step against ``plan.comm`` at its
    own coordinate, and the plan's default (the busiest pipeline rank)."""
    import meshlab as ml
    from meshlab.estimate.comm import CommCounter

    mesh = ml.Mesh(pp=2, tp=2)
    spec = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | \
        ml.pipeline("pp", schedule=schedule, microbatches=2)
    plan = ml.plan(M.build("llama", num_hidden_layers=4), spec, mesh)
    model = ml.parallelize(M.build("llama", num_hidden_layers=4), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    data = M.batches(2, batch=B, seq=S)
    _run_step(model, opt, data[0])                 # warm-up: the stages' shape inference
    with CommCounter(per_module=False) as cc:      # a schedule runs stages outside parents
        _run_step(model, opt, data[1])
    coord = mesh.coordinate(rank)
    est = plan.comm(batch=B, seq=S, coord=coord)
    got = {k: (cc.count(k), cc.bytes(k)) for k in PP_KINDS}
    want = {k: (est.count(k), est.bytes(k)) for k in PP_KINDS}
    assert got == want, (schedule, coord, got, want)
    assert got["send"][0] > 0 and got["recv"][0] > 0
    # the pipeline's sends go to one peer of the pp group, of size 2
    assert {size for kind, size, _ in cc.calls if kind in ("send", "recv")} == {2}
    default = plan.comm(batch=B, seq=S)
    return coord, got, {k: (default.count(k), default.bytes(k)) for k in PP_KINDS}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_collectives_match_the_plan(world4, schedule):
    out = world4.run(pp_comm_case, schedule=schedule)
    default = out[0][2]
    assert default in [got for _, got, _ in out]    # the default is one real rank's step
    # ... the busiest: no rank sends or all-reduces more
    for _, got, _ in out:
        assert all(got[k] <= default[k] for k in ("send", "all_reduce")), (got, default)


def memory_case(rank, world, spec_name):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import meshlab as ml

    overrides = dict(hidden_size=64, intermediate_size=256, vocab_size=256)
    mesh = M.mesh_for(spec_name, world)
    plan = ml.plan(M.build("llama", **overrides), M.spec(spec_name), mesh)
    model = ml.parallelize(M.build("llama", **overrides), M.spec(spec_name), mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    b = torch.randint(0, 256, (B, S)).chunk(rt.dp_size)[dp_rank]
    for _ in range(2):
        loss = M.loss_fn("llama")(model(input_ids=b), {"input_ids": b})
        loss.backward()
        opt.step()            # gradients and optimizer state are both alive here
        seen, total = set(), 0

        def add(t):
            nonlocal total
            if t is None:
                return
            t = t.to_local() if isinstance(t, DTensor) else t
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()

        for p in model.parameters():
            add(p)
            add(p.grad)
        for s in getattr(opt, "shards", []):
            add(s)
            add(s.grad)
        for st in opt.inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    add(v)
        opt.zero_grad()
    est = plan.memory().total
    assert abs(total - est) <= 0.15 * est, (spec_name, total, est)
    return total, est


@pytest.mark.parametrize("spec_name", ["dp", "zero1", "zero2", "zero3", "tp", "tp_zero3"])
def test_memory_matches_the_plan(world4, spec_name):
    out = world4.run(memory_case, spec_name=spec_name)
    measured, est = out[0]
    assert measured > 0 and est > 0


def overflow_case(rank, world, spec_name):
    import torch.distributed as dist

    import meshlab as ml

    spec = M.spec(spec_name) | ml.precision("fp16")
    mesh = M.mesh_for(spec_name, world)
    model = ml.parallelize(M.build("llama"), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    data = M.batches(2)
    loss0 = _run_step(model, opt, data[0].chunk(rt.dp_size)[dp_rank])
    assert torch.isfinite(torch.tensor(loss0))
    scale = opt.scaler.scale
    before = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    b = data[1].chunk(rt.dp_size)[dp_rank]
    loss = M.loss_fn("llama")(model(input_ids=b), {"input_ids": b})
    opt.scale(loss).backward()
    if rank == 1:     # an overflow on one rank only
        p = next(p for p in model.parameters() if p.grad is not None)
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g.view(-1)[0] = float("inf")
    stepped = opt.step()
    assert stepped is False
    assert opt.scaler.scale == scale / 2 and opt.scaler.skipped == 1
    for n, p in model.named_parameters():
        assert torch.equal(M.full(p).detach(), before[n]), n
    return opt.scaler.state_dict()


@pytest.mark.parametrize("spec_name", ["dp", "zero1", "tp"])
def test_fp16_overflow_on_one_rank_skips_everywhere(world4, spec_name):
    states = world4.run(overflow_case, spec_name=spec_name)
    assert all(s == states[0] for s in states)


def bad_input_case(rank, world, what):
    import meshlab as ml
    from meshlab import P
    from meshlab.estimate.comm import CommCounter

    with CommCounter() as cc:
        try:
            if what == "mesh_larger_than_world":
                ml.parallelize(M.build("llama"), M.spec("dp"), ml.Mesh(dp=8))
            elif what == "not_divisible":
                ml.parallelize(M.build("llama", num_attention_heads=8, num_key_value_heads=8,
                                       intermediate_size=66),
                               M.spec("tp"), ml.Mesh(dp=1, tp=4))
            elif what == "unknown_axis":
                ml.parallelize(M.build("llama"),
                               ml.shard({"model.layers.*.mlp.up_proj.weight": P("xx", None)}),
                               ml.Mesh(dp=2, tp=2))
            elif what == "glob_matches_nothing":
                pol = ml.policies.Policy("broken", modules=(
                    ml.policies.ModuleRule("layers.*.mlp.upp_proj", "colwise"),))
                ml.parallelize(M.build("llama"), ml.shard(pol, ml.Rules(mlp="tp")),
                               ml.Mesh(dp=2, tp=2))
            elif what == "unused_axis":
                ml.parallelize(M.build("llama"), ml.zero_shard(3, "dp"), ml.Mesh(dp=2, tp=2))
        except ml.MeshlabError as e:
            err = (type(e).__name__, str(e))
        else:
            raise AssertionError(f"{what}: no error")
    # raised before any collective of the model; the only exchange is the ranks' agreement
    assert [c for c in cc.calls if c[0] != "control"] == [], cc.calls
    return err


@pytest.mark.parametrize("what,etype,words", [
    ("mesh_larger_than_world", "MeshError", ["8", "4 processes"]),
    ("not_divisible", "SpecError", ["66 % 4 != 0", "mlp", "uneven=True"]),
    ("unknown_axis", "SpecError", ["'xx'", "up_proj"]),
    ("glob_matches_nothing", "PolicyError", ["upp_proj", "matches no module"]),
    ("unused_axis", "ConfigError", ["'tp'", "used by no transform"]),
])
def test_bad_input_fails_everywhere_before_any_collective(world4, what, etype, words):
    errs = world4.run(bad_input_case, what=what, timeout=120)
    assert all(e == errs[0] for e in errs)
    name, msg = errs[0]
    assert name == etype, errs[0]
    for w in words:
        assert w in msg, (w, msg)
