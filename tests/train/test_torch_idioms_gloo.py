"""A parallelized model used the way a PyTorch or Hugging Face user would, on 4 gloo ranks,
against the single-process model.

* ``out = model(input_ids=x, labels=x); out.loss.backward()`` under a vocabulary-parallel
  head: the model's own loss is the single-process loss.
* A bare ``torch.optim.AdamW(model.parameters())`` trains correctly under every transform:
  gradients are synchronized by the backward (bucketed, launched while it still runs).
* ``meshlab.optimizer`` is a ``torch.optim.Optimizer``: schedulers, ``param_groups``,
  ``state_dict``.
* ``step``'s batch convention, and the typed errors when a model does not follow it.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(900)
LR = 1e-3


def _dp_rank(model):
    import torch.distributed as dist

    rt = model._meshlab
    return (dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0), rt.dp_size


def _local(model, b):
    r, n = _dp_rank(model)
    return b.chunk(n)[r]


def hf_loss_case(rank, world, family, spec_name):
    """``out.loss`` of the model itself, trained with a plain torch optimizer."""
    import meshlab as ml

    data = M.batches(3)
    ref = ml.init_weights(M.build(family), seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    model = ml.parallelize(M.build(family), M.spec(spec_name), M.mesh_for(spec_name, world),
                           seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for b in data:
        x = _local(model, b)
        want = ref(input_ids=x, labels=x).loss      # this rank's batch, one process
        out = model(input_ids=x, labels=x)
        torch.testing.assert_close(out.loss, want, atol=1e-5, rtol=1e-4)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()          # the reference trains on the global batch
        ref(input_ids=b, labels=b).loss.backward()
        ref_opt.step()
    M.assert_weights_match(model, ref)
    return float(out.loss)


@pytest.mark.parametrize("family,spec_name", [("llama", "tp"), ("llama", "tp_sp"),
                                              ("gpt2", "tp"), ("bert", "tp"),
                                              ("qwen2", "tp_zero3")])
def test_hf_loss_under_tensor_parallel(world4, family, spec_name):
    world4.run(hf_loss_case, family=family, spec_name=spec_name)


def _spec(name: str):
    import meshlab as ml

    specs = {
        "seq_ulysses": (ml.sequence("sp", "all_to_all") | ml.data_parallel("dp"),
                        ml.Mesh(dp=2, sp=2)),
        "seq_ring": (ml.sequence("sp", "ring") | ml.data_parallel("dp"), ml.Mesh(dp=2, sp=2)),
        "pp_dp": (ml.pipeline("pp", schedule="1f1b", microbatches=2) | ml.data_parallel("dp"),
                  ml.Mesh(pp=2, dp=2)),
        "remat_dp": (ml.data_parallel("dp") | ml.remat("full"), ml.Mesh(dp=4)),
        "fuse_tp": (M.spec("tp") | ml.fuse("rms_norm", "rotary", "attention"), ml.Mesh(dp=2, tp=2)),
    }
    if name in specs:
        return specs[name]
    return M.spec(name), M.mesh_for(name, 4)


def bare_optimizer_case(rank, world, spec_name, steps=3):
    """Plain ``loss.backward(); opt.step()`` with ``torch.optim.AdamW``."""
    import meshlab as ml

    over = dict(num_hidden_layers=4) if spec_name.startswith("pp") else {}
    data = M.batches(steps)
    ref, ref_losses, _ = M.reference("llama", data, LR, **over)
    spec, mesh = _spec(spec_name)
    model = ml.parallelize(M.build("llama", **over), spec, mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for b in data:
        x = _local(model, b)
        if spec_name.startswith("pp"):    # a pipeline runs its schedule inside step
            losses.append(ml.step(model, opt, {"input_ids": x}))
            continue
        loss = ml.losses.causal_lm_loss(model(input_ids=x), {"input_ids": x})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if not spec_name.startswith("pp"):    # per-rank losses: check the mean
        import torch.distributed as dist

        rt = model._meshlab
        t = torch.tensor(losses, dtype=torch.float64)
        if rt.dp_group is not None:
            dist.all_reduce(t, group=rt.dp_group)
            t /= rt.dp_size
        losses = t.tolist()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5,
                               rtol=1e-3, check_dtype=False)
    M.assert_weights_match(model, ref)
    return losses


@pytest.mark.parametrize("spec_name", ["dp", "zero2", "zero3", "tp", "tp_sp", "tp_zero3",
                                       "tp_fsdp_2d", "seq_ulysses", "seq_ring", "pp_dp",
                                       "remat_dp", "fuse_tp"])
def test_bare_torch_optimizer_matches_one_process(world4, spec_name):
    world4.run(bare_optimizer_case, spec_name=spec_name)


def precision_case(rank, world):
    """bf16: a plain loop computes as ``step`` does (the forward runs in autocast)."""
    import meshlab as ml

    spec = ml.data_parallel("dp") | ml.precision("bf16")
    data = M.batches(2)
    a = ml.parallelize(M.build("llama"), spec, ml.Mesh(dp=world), seed=0)
    b = ml.parallelize(M.build("llama"), spec, ml.Mesh(dp=world), seed=0)
    opt_a = ml.optimizer(a, torch.optim.AdamW, lr=LR)
    opt_b = torch.optim.AdamW(b.parameters(), lr=LR)
    for batch in data:
        x = _local(a, batch)
        ml.step(a, opt_a, {"input_ids": x})
        out = b(input_ids=x)
        assert out.logits.dtype == torch.bfloat16, out.logits.dtype
        ml.losses.causal_lm_loss(out, {"input_ids": x}).backward()
        opt_b.step()
        opt_b.zero_grad()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_plain_loop_runs_the_precision(world4):
    world4.run(precision_case)


def zero1_bare_case(rank, world):
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), M.spec("zero1"), M.mesh_for("zero1", world), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = _local(model, M.batches(1)[0])
    ml.losses.causal_lm_loss(model(input_ids=x), {"input_ids": x}).backward()
    try:
        opt.step()
    except ml.ConfigError as e:
        return str(e)
    raise AssertionError("a plain optimizer stepped a zero_shard(1) model")


def test_zero1_refuses_a_plain_optimizer(world4):
    msg = world4.run(zero1_bare_case)[0]
    assert "zero_shard(1)" in msg and "meshlab.optimizer" in msg


def overlap_case(rank, world):
    """Small buckets: all but the last reduction start while the backward still runs."""
    import meshlab as ml
    from meshlab.transforms._gradsync import GradSync, plan_reductions

    model = ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=world), seed=0)
    rt = model._meshlab
    rt.grad_sync.remove()
    params = [(n, p) for n, p in model.named_parameters()]
    rt.grad_sync = GradSync(params, plan_reductions(rt.plan), rt, bucket_mb=0.01)
    x = _local(model, M.batches(1)[0])
    ml.losses.causal_lm_loss(model(input_ids=x), {"input_ids": x}).backward()
    return dict(rt.grad_sync.launched), len(rt.grad_sync.buckets)


def test_gradient_buckets_overlap_the_backward(world4):
    launched, n = world4.run(overlap_case)[0]
    assert n > 3, n
    assert launched["in_backward"] == n and launched["at_end"] == 0, launched


def accumulate_case(rank, world):
    """``no_sync`` over microbatches equals one backward of their sum."""
    import meshlab as ml

    data = M.batches(1, batch=8)
    ref, ref_losses, _ = M.reference("llama", data, LR)
    model = ml.parallelize(M.build("llama"), M.spec("tp"), M.mesh_for("tp", world), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = _local(model, data[0])
    a, b = x.chunk(2)
    with ml.no_sync(model):
        (ml.losses.causal_lm_loss(model(input_ids=a), {"input_ids": a}) / 2).backward()
    (ml.losses.causal_lm_loss(model(input_ids=b), {"input_ids": b}) / 2).backward()
    opt.step()
    M.assert_weights_match(model, ref)


def test_no_sync_accumulates(world4):
    world4.run(accumulate_case)


def scheduler_case(rank, world):
    """``meshlab.optimizer`` under torch's schedulers and state dicts."""
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), M.spec("zero1"), M.mesh_for("zero1", world), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1.0, clip_grad_norm=1.0)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    lrs = []
    for b in M.batches(3):
        ml.step(model, opt, {"input_ids": _local(model, b)})
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.25, 0.125], lrs
    sd = opt.state_dict()
    assert set(sd) >= {"state", "param_groups"}
    again = ml.optimizer(model, torch.optim.AdamW, lr=1.0)
    again.load_state_dict(sd)
    assert again.param_groups[0]["lr"] == 0.125
    for p, q in zip(opt.inner.param_groups[0]["params"], again.inner.param_groups[0]["params"]):
        torch.testing.assert_close(again.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    return lrs


def test_mesh_optimizer_is_a_torch_optimizer(world4):
    world4.run(scheduler_case)


class _Tiny(torch.nn.Module):
    """A model whose forward takes ``idx``, not ``input_ids``."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(97, 16)
        self.out = torch.nn.Linear(16, 97)

    def forward(self, idx):
        return self.out(self.emb(idx))


def convention_case(rank, world):
    import meshlab as ml

    torch.manual_seed(0)
    model = ml.parallelize(_Tiny(), ml.data_parallel("dp"), ml.Mesh(dp=world))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 97, (2, 8))
    msgs = []
    for batch, kw in (({"input_ids": x}, {}), ({"idx": x}, {})):
        try:
            ml.step(model, opt, batch, **kw)
        except ml.ConfigError as e:
            msgs.append(str(e))
    loss = ml.step(model, opt, {"input_ids": x}, inputs=["input_ids"])
    loss2 = ml.step(model, opt, {"tokens": x}, inputs=lambda b: (b["tokens"],),
                    loss_fn=lambda out, b: ml.losses.causal_lm_loss(out, {"input_ids": b["tokens"]}))
    return msgs, loss, loss2


def test_step_convention_errors(world2):
    msgs, loss, loss2 = world2.run(convention_case)[0]
    assert len(msgs) == 2, msgs
    assert "input_ids" in msgs[0] and "idx" in msgs[0] and "inputs=" in msgs[0], msgs[0]
    assert "labels" in msgs[1] and "loss_fn" in msgs[1], msgs[1]
    assert loss > 0 and loss2 > 0
