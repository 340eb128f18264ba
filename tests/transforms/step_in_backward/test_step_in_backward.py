"""step_in_backward(): each parameter updated as its gradient completes, on one process.

Against the ordinary step of the same spec: the same losses, weights and optimizer state
(torch's AdamW and meshlab's FusedAdamW, with fused ops and some blocks checkpointed,
under bf16 autocast, with the blocks compiled, and with torchao's float8 layers);
at most one block's gradients alive at any point of the backward, and the optimizer
freed with the model; the state dict loads into the
plain optimizer; the plan holds no gradients; what it is not shown with is refused, by
plan and parallelize alike, before anything runs."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import meshlab as ml
from meshlab.policies import presets
from meshlab.ops import FusedAdamW
from meshlab.transforms.step_in_backward import bucket_of

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_process")]


@pytest.fixture(scope="module")
def base():
    return ml.init_weights(presets.build("tiny-llama", num_hidden_layers=3), seed=0)


def _ids(seed=0):
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))


def _train(base, spec, cls, steps=3):
    model = ml.parallelize(copy.deepcopy(base), spec, ml.Mesh(dp=1))
    opt = ml.optimizer(model, cls, lr=1e-2, weight_decay=0.1)
    losses = [ml.step(model, opt, {"input_ids": _ids()}) for _ in range(steps)]
    return model, opt, losses


SPECS = {"fuse_remat": lambda: ml.fuse() | ml.remat("full", count=2),
         "bf16": lambda: ml.precision("bf16"),
         "compiled": lambda: ml.fuse() | ml.compile_blocks(backend="aot_eager"),
         "fp8": lambda: ml.precision("fp8")}


@pytest.mark.parametrize("cls,spec", [(torch.optim.AdamW, "fuse_remat"),
                                      (FusedAdamW, "fuse_remat"), (torch.optim.AdamW, "bf16"),
                                      (FusedAdamW, "compiled"), (torch.optim.AdamW, "fp8")])
def test_trains_as_the_ordinary_step(base, cls, spec):
    name, spec = spec, SPECS[spec]()
    ref, ref_opt, ref_losses = _train(base, spec, cls)
    got, got_opt, losses = _train(base, spec | ml.step_in_backward(), cls)
    assert losses == ref_losses and losses[-1] < losses[0]
    if name == "fp8":                  # torchao's float8 layers, stepped in the backward
        assert any(type(m).__name__ == "Float8Linear" for m in got.modules())
    for (n, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
    want, have = ref_opt.state_dict(), got_opt.state_dict()
    assert have["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(have["state"][i][k], v, rtol=0, atol=0)
    # The state dict is the plain optimizer's: it loads into one and steps from there.
    plain = cls(got.parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(have)


def test_one_blocks_gradients_alive_at_a_time_and_none_after_the_backward(base):
    model = ml.parallelize(copy.deepcopy(base), ml.step_in_backward(), ml.Mesh(dp=1))
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    alive = []
    # Registered after the optimizer's hooks: each sees the gradients the others left.
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(q.grad is not None for q in params)))
    ids = _ids()
    loss = ml.losses.causal_lm_loss(model(input_ids=ids), {"input_ids": ids})
    loss.backward()
    # A block's gradients wait for the block's last; outside the blocks none waits.
    block = sum(1 for n, _ in model.named_parameters() if n.startswith("model.layers.0."))
    assert len(alive) == len(params) and 0 < max(alive) < block, alive
    assert all(p.grad is None for p in params)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    after = [p.detach().clone() for p in params]
    opt.step()                                  # nothing left to update
    assert all(torch.equal(p.detach(), a) for p, a in zip(params, after))
    # A gradient set by hand is stepped by opt.step(), not lost.
    w = params[0].detach().clone()
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert params[0].grad is None and not torch.equal(params[0].detach(), w)
    # The hooks hold the optimizer weakly: dropped with the model, it is freed.
    ref = weakref.ref(opt.inner)
    del opt, model, params
    gc.collect()
    assert ref() is None


def test_the_plan_holds_no_gradients(base):
    mesh = ml.Mesh(dp=1, fake=True)
    plain = ml.plan(base, ml.fuse(), mesh).memory(batch=2, seq=32)
    early = ml.plan(base, ml.fuse() | ml.step_in_backward(), mesh).memory(batch=2, seq=32)
    assert plain.grads > 0 and early.grads == 0
    sizes: dict[str, int] = {}
    for n, p in base.named_parameters():
        b = bucket_of(n, tuple(f"model.layers.{i}" for i in range(3)))
        sizes[b] = sizes.get(b, 0) + p.numel() * p.element_size()
    assert [r.total for r in early.transients] == [max(sizes.values())]
    assert early.peak <= plain.peak


def test_refusals(base):
    fake2 = ml.Mesh(dp=2, fake=True)
    for spec, mesh, match in (
            (ml.zero_shard(2, "dp") | ml.step_in_backward(), fake2, "zero_shard"),
            (ml.zero_shard(3, "dp", replicate="rep") | ml.step_in_backward(),
             ml.Mesh(rep=2, dp=2, fake=True), "replicate='rep'.*not yet shown"),
            (ml.data_parallel("dp") | ml.step_in_backward(), fake2, "stage=0"),
            (ml.step_in_backward(), fake2, "mesh of 2 ranks")):
        with pytest.raises(ml.ConfigError, match=match):
            ml.plan(base, spec, mesh)
    with pytest.raises(ml.ConfigError, match="not yet shown"):
        ml.parallelize(copy.deepcopy(base), ml.offload(optimizer=1.0) | ml.step_in_backward(),
                       ml.Mesh(dp=1))
    model = ml.parallelize(copy.deepcopy(base), ml.step_in_backward(), ml.Mesh(dp=1))
    for kw, what in (({"clip_grad_norm": 1.0}, "clip_grad_norm"),
                     ({"nonfinite": "skip"}, "nonfinite")):
        with pytest.raises(ml.ConfigError, match=what):
            ml.optimizer(model, torch.optim.AdamW, lr=1e-2, **kw)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2)
    w = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ml.ConfigError, match="microbatches"):
        ml.step(model, opt, {"input_ids": _ids()}, microbatches=2)
    assert all(torch.equal(a, p.detach()) for a, p in zip(w, model.parameters()))
    with pytest.raises(ml.ConfigError, match="no_sync"):
        with ml.no_sync(model):
            pass
