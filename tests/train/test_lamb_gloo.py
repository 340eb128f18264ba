"""LAMB (``meshlab.booster.nn.optimizer.Lamb``, Colossal-AI's) on 4 gloo ranks.

LAMB scales each parameter's update by its trust ratio ``||w|| / ||update||``, a norm over
the whole tensor. Under tensor parallelism by specs, ZeRO-3 (FSDP2) and both (one rank
holding empty shards) the parameters are DTensors and ``torch.norm`` of one is the full
tensor's norm, so three steps give one process's losses and weights (float64, to 1e-12);
so does a Hugging Face llama under its policy's TP x ZeRO-3 (float32, 1e-5), and the
Booster (``TorchFSDPPlugin``, two parameter groups), also after a checkpoint resume.
ZeRO-1 steps flat slices of the parameters for elementwise optimizers, where the norms
would be the slices'; LAMB there steps whole tensors, each parameter owned by one of the 4
data ranks (four tensors of unequal sizes), and trains as one process too, through
``meshlab.optimizer`` and through ``boost`` under ``LowLevelZeroPlugin(stage=1)``. A
trust ratio computed per shard fails each layout's comparison.

The one-process reference is itself checked against LAMB's formula as Colossal-AI writes
it (written out here step by step), on tensors whose norm exceeds the library's default
clamp of 10."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH = 3, 8          # BATCH: the global batch
TOL = dict(atol=1e-12, rtol=1e-10)
# (hyper-parameters): Colossal-AI's defaults with weight decay; its bias correction.
CONFIGS = [dict(lr=2e-2, weight_decay=0.01), dict(lr=1e-2, bias_correction=True)]


class Net(nn.Module):
    """``out`` has 6 rows: ZeRO-3 over 4 ranks leaves one of them an empty shard."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(STEPS, BATCH, 8, generator=g, dtype=torch.float64),
            torch.randn(STEPS, BATCH, 6, generator=g, dtype=torch.float64))


def _base():
    torch.manual_seed(0)
    return Net().double()


def _reference(kw):
    """One process: LAMB on the whole global batch; (losses, weights)."""
    from meshlab.booster.nn.optimizer import Lamb

    data, target = _data()
    ref = _base()
    opt = Lamb(ref.parameters(), **kw)
    losses = []
    for s in range(STEPS):
        loss = nn.functional.mse_loss(ref(data[s]), target[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in ref.named_parameters()}


def _layouts():
    import meshlab as ml
    from meshlab import P

    tp = {"inp.weight": P("tp", None), "inp.bias": P("tp"), "out.weight": P(None, "tp")}
    return {"tp": (ml.shard(tp), ml.Mesh(tp=4)),
            "zero3": (ml.zero_shard(3, "dp"), ml.Mesh(dp=4)),
            "tp_zero3": (ml.shard(tp) | ml.zero_shard(3, "dp"), ml.Mesh(dp=2, tp=2))}


def case_layouts(rank, world):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import meshlab as ml
    from meshlab.booster.nn.optimizer import Lamb

    data, target = _data()
    for kw in CONFIGS:
        want_losses, want = _reference(kw)
        for lname, (spec, mesh) in _layouts().items():
            model = ml.parallelize(_base(), spec, mesh)
            assert all(isinstance(p, DTensor) for p in model.parameters()), lname
            opt = ml.optimizer(model, Lamb, **kw)
            rt = model._meshlab
            r = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
            mine = slice(r * BATCH // rt.dp_size, (r + 1) * BATCH // rt.dp_size)
            losses = [ml.step(model, opt, {"x": data[s, mine], "y": target[s, mine]},
                              lambda out, b: nn.functional.mse_loss(out, b["y"]),
                              inputs=["x"]) for s in range(STEPS)]
            torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                       torch.tensor(want_losses, dtype=torch.float64),
                                       **TOL, msg=lambda m: f"{lname} {kw} losses: {m}")
            for n, p in model.named_parameters():
                torch.testing.assert_close(_full(p).detach(), want[n], **TOL,
                                           msg=lambda m, n=n: f"{lname} {kw} {n}: {m}")
            # Colossal-AI's state keys (the library's last norms are dropped).
            assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"}
                       for s in opt.state.values()), lname
    return True


def case_policy(rank, world):
    """A Hugging Face llama under its policy (the local-shard path: modules compute on local
    shards, the parameters stay DTensors), TP x ZeRO-3 on dp=2 x tp=2, float32."""
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.booster.nn.optimizer import Lamb
    from tests import _models as M

    kw = dict(lr=1e-2, weight_decay=0.01, bias_correction=True)
    data = M.batches(STEPS, batch=4)
    loss_fn = M.loss_fn("llama")
    model = ml.parallelize(M.build("llama"), M.spec("tp_zero3"), M.mesh_for("tp", world),
                           seed=0)
    opt = ml.optimizer(model, Lamb, **kw)
    rt = model._meshlab
    r = dist.get_rank(rt.dp_group)
    losses = [ml.step(model, opt, {"input_ids": b.chunk(rt.dp_size)[r]}) for b in data]

    ref = ml.init_weights(M.build("llama"), seed=0)
    ref_opt = Lamb(ref.parameters(), **kw)
    want = []
    for b in data:
        loss = loss_fn(ref(input_ids=b), {"input_ids": b, "labels": b})
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), atol=1e-5, rtol=1e-5)
    M.assert_weights_match(model, ref, atol=1e-5, rtol=1e-4)
    return True


def case_zero1(rank, world):
    """ZeRO-1 at dp=4: each parameter stepped whole by its owner, the largest first to
    the rank holding the fewest bytes; also through the Booster's LowLevelZeroPlugin."""
    import meshlab as ml
    from meshlab.booster import Booster
    from meshlab.booster.nn.optimizer import Lamb
    from meshlab.booster.plugin import LowLevelZeroPlugin

    data, target = _data()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for kw in CONFIGS:
        want_losses, want = _reference(kw)
        model = ml.parallelize(_base(), ml.zero_shard(1, "dp"), ml.Mesh(dp=4))
        opt = ml.optimizer(model, Lamb, **kw)
        assert opt.zero1.owners == {"inp.weight": 0, "out.weight": 1, "inp.bias": 2,
                                    "out.bias": 3}, opt.zero1.owners
        losses = [ml.step(model, opt, {"x": data[s, mine], "y": target[s, mine]},
                          lambda out, b: nn.functional.mse_loss(out, b["y"]),
                          inputs=["x"]) for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(want_losses, dtype=torch.float64), **TOL)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), want[n], **TOL,
                                       msg=lambda m, n=n: f"zero1 {kw} {n}: {m}")
    kw = CONFIGS[0]
    _, want = _reference(kw)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32"))
    base = _base()
    model, opt = booster.boost(base, Lamb(base.parameters(), **kw))[:2]
    for s in range(STEPS):
        booster.backward(nn.functional.mse_loss(model(data[s, mine]), target[s, mine]), opt)
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], **TOL,
                                   msg=lambda m, n=n: f"LowLevelZeroPlugin(stage=1) {n}: {m}")
    return True


def _groups(model, lr):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.01},
            {"params": rest, "weight_decay": 0.0, "lr": 2 * lr}]


def case_booster(rank, world, path):
    """TorchFSDPPlugin: two groups, three steps as one process; a run saved after two
    steps and resumed in a fresh model (other initial weights) takes the same third step
    (the bias correction reads the restored step count)."""
    import torch.distributed as dist

    from meshlab.booster import Booster
    from meshlab.booster.nn.optimizer import Lamb
    from meshlab.booster.plugin import TorchFSDPPlugin

    kw = dict(lr=1e-2, bias_correction=True)
    data, target = _data()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

    def boosted(model):
        booster = Booster(plugin=TorchFSDPPlugin())
        return (booster, *booster.boost(model, Lamb(_groups(model, kw["lr"]), **kw))[:2])

    def train(booster, model, opt, s):
        loss = nn.functional.mse_loss(model(data[s, mine]), target[s, mine])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / world

    booster, model, opt = boosted(_base())
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert [g["bias_correction"] for g in opt.param_groups] == [True, True]
    losses = [train(booster, model, opt, s) for s in range(STEPS - 1)]
    booster.save_model(model, f"{path}/model")
    booster.save_optimizer(opt, f"{path}/optimizer")
    torch.manual_seed(5)
    booster2, resumed, opt2 = boosted(Net().double())
    booster2.load_model(resumed, f"{path}/model")
    booster2.load_optimizer(opt2, f"{path}/optimizer")
    losses.append(train(booster, model, opt, STEPS - 1))
    resumed_loss = train(booster2, resumed, opt2, STEPS - 1)

    ref = _base()
    ref_opt = Lamb(_groups(ref, kw["lr"]), **kw)
    want = []
    for s in range(STEPS):
        loss = nn.functional.mse_loss(ref(data[s]), target[s])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), **TOL)
    assert math.isclose(resumed_loss, want[-1], rel_tol=1e-10)
    for name, m in (("uninterrupted", model), ("resumed", resumed)):
        got = {n: _full(p).detach() for n, p in m.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), **TOL,
                                       msg=lambda msg, n=n: f"{name} {n}: {msg}")
    return True


def test_lamb_trains_tp_zero3_and_both_as_one_process(world4):
    assert world4.run(case_layouts) == [True] * 4


def test_lamb_under_a_policy_trains_as_one_process(world4):
    assert world4.run(case_policy) == [True] * 4


def test_lamb_under_zero1_trains_whole_tensors_as_one_process(world4):
    assert world4.run(case_zero1) == [True] * 4


def test_lamb_through_the_booster_trains_and_resumes_as_one_process(world4, tmp_path):
    assert world4.run(case_booster, path=str(tmp_path)) == [True] * 4


# -- one process: the update is Colossal-AI's --------------------------------------------

def _colossal_lamb(w, grads, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                   adam=False, bias_correction=False):
    """LAMB as Colossal-AI defines it, written out: Adam's moments, the update
    m / (sqrt(v) + eps) + weight_decay * w, scaled by ||w|| / ||update|| (unclamped; 1
    where a norm is 0 or with adam), the rate times sqrt(1 - b2^t) / (1 - b1^t) with bias
    correction."""
    w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        rate = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
        update = m / (v.sqrt() + eps) + weight_decay * w
        wn, un = w.norm(), update.norm()
        ratio = 1.0 if adam or wn == 0 or un == 0 else wn / un
        w = w - rate * ratio * update
    return w


@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=3e-2, weight_decay=0.1),
                                dict(lr=1e-2, bias_correction=True, betas=(0.8, 0.99)),
                                dict(lr=1e-2, adam=True, eps=1e-4)], ids=str)
def test_the_update_is_colossal_ais(kw):
    from meshlab.booster.nn.optimizer import Lamb

    g = torch.Generator().manual_seed(0)
    w0 = 5 * torch.randn(7, 5, generator=g, dtype=torch.float64)     # ||w|| ~ 30 > 10
    grads = [torch.randn(7, 5, generator=g, dtype=torch.float64) for _ in range(4)]
    p = nn.Parameter(w0.clone())
    opt = Lamb([p], **kw)
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), _colossal_lamb(w0, grads, **kw), atol=1e-13,
                               rtol=1e-12)
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def test_bias_correction_per_group_and_lr_zero():
    from meshlab.booster.nn.optimizer import Lamb

    g = torch.Generator().manual_seed(0)
    w0 = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    grads = [[torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3)]
             for _ in w0]
    ps = [nn.Parameter(w.clone()) for w in w0]
    opt = Lamb([{"params": [ps[0]]}, {"params": [ps[1]], "bias_correction": True},
                {"params": [ps[2]], "lr": 0.0}], lr=1e-2)
    assert Lamb([nn.Parameter(torch.ones(2))], lr=0.0).defaults["lr"] == 0.0
    for t in range(3):
        for p, gr in zip(ps, grads):
            p.grad = gr[t].clone()
        opt.step()
    torch.testing.assert_close(ps[0].detach(), _colossal_lamb(w0[0], grads[0], lr=1e-2))
    torch.testing.assert_close(ps[1].detach(), _colossal_lamb(w0[1], grads[1], lr=1e-2,
                                                              bias_correction=True))
    assert torch.equal(ps[2].detach(), w0[2])
    # the groups' rules differ enough to tell apart
    assert not torch.allclose(ps[1].detach(), _colossal_lamb(w0[1], grads[1], lr=1e-2))


def test_lamb_names_its_extra_when_torch_optimizer_is_missing(monkeypatch):
    import sys

    from meshlab.core.log import MissingExtraError

    monkeypatch.setitem(sys.modules, "torch_optimizer", None)
    monkeypatch.delitem(sys.modules, "meshlab.booster._lamb", raising=False)
    from meshlab.booster.nn import optimizer

    with pytest.raises(MissingExtraError, match=r"pip install 'meshlab\[optim\]'"):
        optimizer.Lamb
