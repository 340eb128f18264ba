"""Pipeline parallelism against the single-process model on gloo processes, and the plan's
stage table and bubble formula."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(900)
LAYERS = dict(num_hidden_layers=4)


def pp_case(rank, world, schedule, mesh_text, extra=None, microbatches=4, steps=3, lr=1e-3,
            family="llama"):
    import torch.distributed as dist

    import meshlab as ml

    data = M.batches(steps, batch=8)
    ref, ref_losses, _ = M.reference(family, data, lr, **LAYERS)
    mesh = ml.Mesh(ml.Mesh.parse(mesh_text).shape)
    spec = ml.pipeline("pp", schedule=schedule, microbatches=microbatches)
    if extra in ("zero1", "zero3"):
        spec = spec | ml.zero_shard(int(extra[-1]), "dp")
    elif extra == "tp":
        spec = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | spec
    elif extra == "fuse":                  # every op, the loss on the last stage's head
        spec = spec | ml.fuse()
    model = ml.parallelize(M.build(family, **LAYERS), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=lr)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    from meshlab.ops import _build

    _build.LAST_PATH.clear()
    losses = [ml.step(model, opt, {"input_ids": b.chunk(rt.dp_size)[dp_rank]}) for b in data]
    ran = {op for op, _ in _build.LAST_PATH}
    if extra == "fuse":                  # the stage really ran meshlab's ops
        assert {"rms_norm", "rotary", "attention", "attention_backward"} <= ran, ran
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               atol=1e-5, rtol=1e-3)
    owned = M.assert_weights_match(model, ref)
    return losses, sorted(owned), len(dict(ref.named_parameters())), sorted(ran)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv"])
def test_pp2(world2, schedule):
    out = world2.run(pp_case, schedule=schedule, mesh_text="pp=2")
    _check_disjoint(out)


def test_pp2_fused_ops(world2):
    """fuse() inside pipeline stages: each stage's norms, rotary and attention on meshlab's
    ops, and the last stage's loss through the fused head (its hidden states and the head's
    weight into ``meshlab::linear_cross_entropy``, the logits never made)."""
    out = world2.run(pp_case, schedule="1f1b", mesh_text="pp=2", extra="fuse")
    _check_disjoint(out)
    assert "linear_cross_entropy" not in out[0][3] and "linear_cross_entropy" in out[1][3]


def fused_loss_refusal_case(rank, world):
    """A loss function of the caller's cannot run on a fused-loss pipeline's last stage
    (it would get hidden states where it expects logits): every rank raises, the first
    stage's too."""
    import meshlab as ml
    from meshlab.transforms._install import runtime_of
    from meshlab.transforms.pipeline._runtime import PipelinePart

    model = ml.parallelize(M.build("llama", **LAYERS), ml.pipeline("pp") | ml.fuse("loss"),
                           ml.Mesh(pp=world), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    ids = M.batches(1, batch=8)[0]
    with pytest.raises(ml.ConfigError, match="this model's loss is fused"):
        ml.step(model, opt, {"input_ids": ids}, loss_fn=M.loss_fn("llama"))
    rt = runtime_of(model)
    with pytest.raises(ml.MeshlabError) as e:
        rt.part(PipelinePart).forward_backward(rt, {"input_ids": ids}, M.loss_fn("llama"))
    return type(e.value).__name__, str(e.value)


def test_a_callers_loss_on_a_fused_loss_pipeline_is_refused_on_every_rank(world2):
    out = world2.run(fused_loss_refusal_case)
    assert out[1][0] == "ConfigError" and "leave 'loss' out of fuse()" in out[1][1]
    assert out[0][0] == "PeerError", out[0]


def bad_loss_case(rank, world, kind):
    """A loss function whose value torch's backward cannot start from, on the last stage:
    every rank raises, none waits, and the weights stay as they were."""
    import meshlab as ml

    model = ml.parallelize(M.build("llama", **LAYERS), ml.pipeline("pp", microbatches=2),
                           ml.Mesh(pp=world), seed=0)
    before = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    ids = M.batches(1, batch=8)[0]

    def loss_fn(out, mb):
        logits = out if torch.is_tensor(out) else out.logits
        per_row = logits.logsumexp(-1).mean(-1)
        return {"rows": per_row, "detached": per_row.mean().detach(),
                "count": (per_row > 0).sum()}[kind]
    with pytest.raises(ml.MeshlabError) as e:
        ml.step(model, opt, {"input_ids": ids}, loss_fn)
    unchanged = all(torch.equal(M.full(p).detach(), before[n])
                    for n, p in model.named_parameters())
    return type(e.value).__name__, str(e.value), unchanged


@pytest.mark.parametrize("kind,says", [
    ("rows", "returned a tensor of shape (4,), not one number"),
    ("detached", "does not depend on the model's output"),
    ("count", "does not depend on the model's output")])
def test_a_loss_the_backward_cannot_start_from_fails_every_stage(world2, kind, says):
    """Before, a loss of one value per row hung every rank: the last stage failed inside
    torch's backward, the first waited for its gradient for good."""
    out = world2.run(bad_loss_case, kind=kind)
    assert out[1][0] == "ConfigError" and says in out[1][1], out[1]
    assert out[0][0] == "PeerError" and says in out[0][1], out[0]
    assert out[0][2] and out[1][2]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_pp2_qwen2(world2, schedule):
    out = world2.run(pp_case, schedule=schedule, mesh_text="pp=2", family="qwen2")
    _check_disjoint(out)


def accumulate_case(rank, world, schedule):
    """Two forward/backward passes through the schedule without zero_grad in between hold
    the sum of the two batches' gradients, as one process does (float64, SGD's update)."""
    import meshlab as ml
    from meshlab.transforms._install import runtime_of
    from meshlab.transforms.pipeline._runtime import PipelinePart

    torch.set_default_dtype(torch.float64)
    try:
        data = M.batches(2, batch=8)
        ref = ml.init_weights(M.build("llama", **LAYERS), seed=0)
        for b in data:
            M.loss_fn("llama")(ref(input_ids=b), {"input_ids": b, "labels": b}).backward()
        model = ml.parallelize(M.build("llama", **LAYERS),
                               ml.pipeline("pp", schedule=schedule, microbatches=4),
                               ml.Mesh(pp=world), seed=0)
        rt = runtime_of(model)
        part = rt.part(PipelinePart)
        for b in data:
            part.forward_backward(rt, {"input_ids": b}, M.loss_fn("llama"))
        grads = {n: p.grad for n, p in ref.named_parameters()}
        checked = 0
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(M.full(p.grad), grads[n], rtol=1e-9, atol=1e-12,
                                           msg=lambda m, n=n: f"grad of {n}: {m}")
                checked += 1
        return checked
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_gradients_accumulate_across_schedule_calls(world2, schedule):
    out = world2.run(accumulate_case, schedule=schedule)
    assert all(n > 0 for n in out)


def _check_disjoint(out):
    names = set(out[0][1]) | set(out[1][1])
    assert not set(out[0][1]) & set(out[1][1])            # stages hold disjoint parameters
    assert len(names) == out[0][2]                          # every parameter is somewhere


@pytest.mark.parametrize("extra,mesh_text", [("zero1", "pp=2,dp=2"), ("zero3", "pp=2,dp=2"),
                                             ("tp", "pp=2,tp=2")])
def test_pp2_composed(world4, extra, mesh_text):
    world4.run(pp_case, schedule="1f1b", mesh_text=mesh_text, extra=extra)


def pp_zero_case(rank, world, stage, schedule, steps=3, lr=0.1):
    """pipeline x zero_shard(stage) on pp=2, dp=2 against one process in float64, with SGD
    (an update is the gradient times ``lr``): each stage module is an FSDP2 root whose
    parameters are split over dp; every step's loss and the weights after each step match;
    then forward/backward calls without zero_grad hold the sum of their batches' gradients:
    two in a row, then a third after an evaluation and with a loss function of another
    identity (torch's schedule sets its stages up again for each, and drops the FSDP2
    stages' gradients when it does)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    import meshlab as ml
    from meshlab.transforms._install import runtime_of
    from meshlab.transforms.pipeline._runtime import PipelinePart

    torch.set_default_dtype(torch.float64)
    try:
        data = M.batches(steps + 3, batch=8)
        loss_fn = M.loss_fn("llama")
        ref = ml.init_weights(M.build("llama", **LAYERS), seed=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
        model = ml.parallelize(M.build("llama", **LAYERS),
                               ml.pipeline("pp", schedule=schedule, microbatches=4)
                               | ml.zero_shard(stage, "dp"),
                               ml.Mesh(pp=2, dp=2), seed=0)
        rt = runtime_of(model)
        part = rt.part(PipelinePart)
        assert all(isinstance(st.submod, FSDPModule) for st in part.stages)
        for n, p in model.named_parameters():       # a quarter of the model on each rank
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), n
            assert p.device_mesh.size() == 2, n
        dp_rank = dist.get_rank(rt.dp_group)
        opt = ml.optimizer(model, torch.optim.SGD, lr=lr)
        for b in data[:steps]:
            want = loss_fn(ref(input_ids=b), {"input_ids": b, "labels": b})
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            got = ml.step(model, opt, {"input_ids": b.chunk(2)[dp_rank]})
            torch.testing.assert_close(got, want.item(), rtol=1e-10, atol=1e-12)
            M.assert_weights_match(model, ref, atol=1e-10, rtol=1e-9)
        rest = [{"input_ids": b.chunk(2)[dp_rank]} for b in data[steps:]]
        for b in data[steps:]:
            loss_fn(ref(input_ids=b), {"input_ids": b, "labels": b}).backward()
            if b is data[steps + 1]:
                after_two = {n: p.grad.clone() for n, p in ref.named_parameters()}
        part.forward_backward(rt, rest[0], loss_fn)
        part.forward_backward(rt, rest[1], loss_fn)
        _grads_match(model, after_two)
        part.forward_only(rt, rest[2], loss_fn)
        part.forward_backward(rt, rest[2], lambda out, batch: loss_fn(out, batch))
        _grads_match(model, {n: p.grad for n, p in ref.named_parameters()})
        held = sum(p.to_local().numel() for p in model.parameters())
        return held, sum(p.numel() for p in ref.parameters())
    finally:
        torch.set_default_dtype(torch.float32)


def pp_fused_loss_zero_case(rank, world, stage, steps=2, lr=0.1):
    """pipeline x zero_shard(stage) x fuse('loss') on pp=2, dp=2 against one process with the
    same fused loss, SGD: the last stage's head is an FSDP2 unit of its own,
    gathered when the schedule's loss calls it after the stage's forward (as the stage's
    root it would be resharded by then under ZeRO-3)."""
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model

    torch.set_default_dtype(torch.float64)
    try:
        data = M.batches(steps, batch=8)
        ref = ml.init_weights(M.build("llama", **LAYERS), seed=0)
        fuse_model(ref, ("loss",))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
        model = ml.parallelize(M.build("llama", **LAYERS),
                               ml.pipeline("pp", microbatches=2) | ml.zero_shard(stage, "dp")
                               | ml.fuse("loss"), ml.Mesh(pp=2, dp=2), seed=0)
        dp_rank = dist.get_rank(model._meshlab.dp_group)
        opt = ml.optimizer(model, torch.optim.SGD, lr=lr)
        for b in data:
            # the one process takes the mean of the same 4 microbatches (2 per data rank);
            # the fused kernel computes in float32, hence float32's tolerance
            want = sum(causal_lm_loss(ref, {"input_ids": m}) for m in b.chunk(4)) / 4
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            got = ml.step(model, opt, {"input_ids": b.chunk(2)[dp_rank]})
            torch.testing.assert_close(got, want.item(), rtol=1e-6, atol=1e-7)
            M.assert_weights_match(model, ref, atol=1e-6, rtol=1e-5)
        return got
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("stage", [2, 3])
def test_pp2_zero_with_a_fused_loss_matches_one_process(world4, stage):
    out = world4.run(pp_fused_loss_zero_case, stage=stage)
    assert len(set(out)) == 1


def _grads_match(model, want: dict) -> None:
    for n, p in model.named_parameters():
        torch.testing.assert_close(M.full(p.grad), want[n], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=n: f"grad of {n}: {m}")


@pytest.mark.parametrize("stage,schedule", [(3, "1f1b"), (3, "interleaved"), (2, "gpipe")])
def test_pp2_zero_matches_one_process(world4, stage, schedule):
    """torchtitan's PP x FSDP2 layout on pp=2, dp=2 (``pp_zero_case``): each rank holds
    about a quarter of the parameters."""
    out = world4.run(pp_zero_case, stage=stage, schedule=schedule)
    total = out[0][1]
    assert sum(o[0] for o in out) == pytest.approx(total, rel=0.02), out  # once, in halves
    assert all(o[0] <= total / 4 * 1.1 for o in out), out


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
@pytest.mark.parametrize("stage", [2, 3])
def test_split_backward_under_fsdp_is_refused(schedule, stage):
    """The split backward of zero_bubble and zbv under FSDP2 stages is refused at plan
    time, naming the schedules that run; zero_shard(1) keeps them."""
    import meshlab as ml

    mesh = ml.Mesh(pp=2, dp=2, fake=True)
    pp = ml.pipeline("pp", schedule=schedule)
    with pytest.raises(ml.ConfigError, match=rf"zero_shard\({stage}\).*schedule='1f1b'"):
        ml.plan(M.build("llama", **LAYERS), pp | ml.zero_shard(stage, "dp"), mesh)
    ml.plan(M.build("llama", **LAYERS), pp | ml.zero_shard(1, "dp"), mesh)


def test_plan_memory_counts_zero_shards_per_stage():
    """pipeline x zero_shard(3) on pp=2, dp=2: a rank holds the shards of its stage's
    parameters, about a quarter of the model's (FSDP2 pads dim 0 to the data ranks)."""
    import meshlab as ml

    model = M.build("llama", **LAYERS)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    for stage in (2, 3):
        mem = ml.plan(model, ml.pipeline("pp") | ml.zero_shard(stage, "dp"),
                      ml.Mesh(pp=2, dp=2, fake=True)).memory()
        assert whole / 4 <= mem.params <= whole / 4 * 1.05, (stage, mem.params, whole)
        assert mem.grads == mem.params
    alone = ml.plan(model, ml.pipeline("pp"), ml.Mesh(pp=2, fake=True)).memory()
    assert mem.params == pytest.approx(alone.params / 2, rel=0.05)


def test_plan_reports_stages_and_bubble():
    import meshlab as ml
    from meshlab.transforms.pipeline import bubble, stages

    model = M.build("llama", num_hidden_layers=8)
    p = ml.plan(model, ml.pipeline("pp", schedule="interleaved", microbatches=8),
                ml.Mesh(pp=4, fake=True))
    st = stages(p)
    assert [s.rank for s in st] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert sum(len(s.blocks) for s in st) == 8 and st[0].first and st[-1].last
    assert bubble(p) == pytest.approx(3 / (2 * 8 + 3))
    p = ml.plan(model, ml.pipeline("pp", schedule="1f1b", microbatches=8), ml.Mesh(pp=4, fake=True))
    assert bubble(p) == pytest.approx(3 / 11)
    with pytest.raises(ml.ConfigError, match="cannot fill"):
        from meshlab.transforms.pipeline import stages as _s

        _s(ml.plan(M.build("llama"), ml.pipeline("pp"), ml.Mesh(pp=4, fake=True)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv", "zero_bubble"])
def test_schedule_picture_and_simulated_bubble(schedule):
    import meshlab as ml
    from meshlab.transforms.pipeline import bubble, draw_schedule, simulate, stages

    p = ml.plan(M.build("llama", num_hidden_layers=8),
                ml.pipeline("pp", schedule=schedule, microbatches=8), ml.Mesh(pp=4, fake=True))
    pic = draw_schedule(p)
    assert pic.count("rank ") == 4 and "idle" in pic
    events = simulate(p)
    n = len(stages(p))
    assert sum(1 for e in events if e[3] == "F") == n * 8      # every microbatch, every stage
    end = max(e[2] for e in events)
    idle = 1 - sum(e[2] - e[1] for e in events) / (4 * end)
    if schedule in ("gpipe", "1f1b", "interleaved"):          # the closed forms hold exactly
        assert idle == pytest.approx(bubble(p))
    else:
        assert idle == pytest.approx(bubble(p)) and idle < 3 / 11


def p2p_case(rank, world, schedule):
    import meshlab as ml
    from meshlab.estimate.comm import CommCounter

    m, B, S, H = 4, 8, 8, 32
    model = ml.parallelize(M.build("llama", **LAYERS),
                           ml.pipeline("pp", schedule=schedule, microbatches=m), ml.Mesh(pp=2))
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    batch = {"input_ids": torch.randint(0, 97, (B, S))}
    ml.step(model, opt, batch)                       # warm-up: shape inference runs once
    with CommCounter(per_module=False) as cc:
        ml.step(model, opt, batch)
    act = (B // m) * S * H * 4                       # one microbatch's hidden states, fp32
    sends = [c for c in cc.calls if c[0] == "send"]
    recvs = [c for c in cc.calls if c[0] == "recv"]
    return (len(sends), sum(c[2] for c in sends), len(recvs), sum(c[2] for c in recvs), act,
            _host_reads(model, batch))


def _host_reads(model, batch) -> int:
    """The device-to-host reads (``.item()``, ``float(t)``: each a round trip on a GPU)
    of one pipelined forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshlab.train.step import _default_loss
    from meshlab.transforms.pipeline._runtime import PipelinePart

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.n += 1
            return func(*args, **(kwargs or {}))

    rt = model._meshlab
    with Reads():
        rt.part(PipelinePart).forward_backward(rt, batch, _default_loss)
    return Reads.n


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_p2p_volume(world2, schedule):
    """Each stage boundary carries every microbatch's activations forward and their
    gradients backward: per step, boundaries x m sends of B/m x S x H fp32 each way."""
    out = world2.run(p2p_case, schedule=schedule)
    assert [o[5] for o in out] == [1, 1], "one read of the step's loss, none per microbatch"
    m = 4
    boundaries = {"1f1b": 1, "interleaved": 3}[schedule]      # stages - 1
    total_sends = sum(o[0] for o in out)
    total_bytes = sum(o[1] for o in out)
    act = out[0][4]
    assert total_sends == 2 * boundaries * m, out
    assert total_bytes == 2 * boundaries * m * act, out
    assert sum(o[2] for o in out) == total_sends and sum(o[3] for o in out) == total_bytes
