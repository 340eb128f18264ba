"""Colossal-AI's other optimizers (``meshlab.booster.nn.optimizer``: ``Lars``, ``CAME``,
``Adafactor``, ``GaLoreAdamW`` and the ``Distributed*`` classes) through ``Booster.boost``
on 2 gloo ranks: under ``LowLevelZeroPlugin(stage=1)`` (each parameter stepped whole by its
owner) and ``TorchFSDPPlugin`` (ZeRO-3: DTensor parameters) three steps give one process's
losses and weights with the same class (float64, 1e-10). None of them updates elementwise,
so a slice or a shard stepped alone would fail the comparison.

One process: ``Lars`` against its update as Colossal-AI defines it, written out here; the
``Distributed*`` classes' ``setup_distributed`` accepts the plugins' arguments; the 8-bit
GaLore is refused by name, and a missing library names its extra."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH = 3, 8
TOL = dict(atol=1e-10, rtol=1e-10)


def _galore_groups(model):
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": w, "rank": 2, "update_proj_gap": 2, "scale": 0.25, "proj_type": "std"},
            {"params": b}]


# (name, keyword arguments, parameter groups or None)
CASES = [("Lars", dict(lr=0.1, momentum=0.9, eeta=0.02, weight_decay=0.01), None),
         ("CAME", dict(lr=1e-2, weight_decay=0.01), None),
         ("Adafactor", dict(), None),
         ("Adafactor", dict(beta1=0.9, weight_decay=0.01, relative_step=False,
                            scale_parameter=False, lr=1e-2), None),
         ("GaLoreAdamW", dict(lr=1e-2, weight_decay=0.01), _galore_groups),
         ("DistributedLamb", dict(lr=1e-2, weight_decay=0.01), None),
         ("DistributedCAME", dict(lr=1e-2), None),
         ("DistributedAdaFactor", dict(beta1=0.9), None)]


def _available(name):
    import importlib.util

    need = {"CAME": "came_pytorch", "DistributedCAME": "came_pytorch",
            "GaLoreAdamW": "galore_torch", "DistributedLamb": "torch_optimizer"}.get(name)
    return need is None or importlib.util.find_spec(need) is not None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def _data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(STEPS, BATCH, 8, generator=g, dtype=torch.float64),
            torch.randn(STEPS, BATCH, 6, generator=g, dtype=torch.float64))


def _base():
    torch.manual_seed(0)
    return Net().double()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(name, kw, groups, model):
    from meshlab.booster.nn import optimizer

    cls = getattr(optimizer, name)
    return cls(groups(model) if groups else model.parameters(), **kw)


def _reference(name, kw, groups):
    data, target = _data()
    ref = _base()
    opt = _build(name, kw, groups, ref)
    losses = []
    for s in range(STEPS):
        loss = nn.functional.mse_loss(ref(data[s]), target[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _plugins():
    from meshlab.booster.plugin import LowLevelZeroPlugin, TorchFSDPPlugin

    return {"LowLevelZeroPlugin(stage=1)": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
            "TorchFSDPPlugin": lambda: TorchFSDPPlugin()}


def case_boost(rank, world, cases):
    import torch.distributed as dist

    from meshlab.booster import Booster

    data, target = _data()
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    init = {n: p.detach().clone() for n, p in _base().named_parameters()}
    done = []
    for i in cases:
        name, kw, groups = CASES[i]
        want_losses, want = _reference(name, kw, groups)
        assert all(not torch.allclose(want[n], init[n]) for n in want), name
        for pname, plugin in _plugins().items():
            booster = Booster(plugin=plugin())
            base = _base()
            built = _build(name, kw, groups, base)
            if hasattr(built, "setup_distributed"):
                built.setup_distributed(None, None, {}, None, False)
            model, opt = booster.boost(base, built)[:2]
            losses = []
            for s in range(STEPS):
                loss = nn.functional.mse_loss(model(data[s, mine]), target[s, mine])
                booster.backward(loss, opt)
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / world)
            what = f"{name} {kw} under {pname}"
            torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                       torch.tensor(want_losses, dtype=torch.float64), **TOL,
                                       msg=lambda m: f"{what} losses: {m}")
            for n, p in model.named_parameters():
                torch.testing.assert_close(_full(p).detach(), want[n], **TOL,
                                           msg=lambda m, n=n: f"{what} {n}: {m}")
            done.append((name, pname))
    return done


def test_colossal_optimizers_train_as_one_process_under_zero1_and_zero3(world2):
    cases = [i for i, (name, _, _) in enumerate(CASES) if _available(name)]
    if not cases:
        pytest.skip("no optimizer library installed")
    got = world2.run(case_boost, cases=cases)
    assert got[0] == got[1] == [(CASES[i][0], p) for i in cases for p in _plugins()]


# -- one process -------------------------------------------------------------------------

def _colossal_lars(w, grads, lr=1e-3, momentum=0, eeta=1e-3, weight_decay=0, epsilon=0.0):
    """LARS as Colossal-AI defines it, written out: the trust ratio eeta ||w|| / (||g|| +
    weight_decay ||w|| + epsilon) (1 where a norm is 0) clamped to [0, 50], the decayed
    gradient clamped to [-10, 10], momentum buf = momentum buf + g."""
    w, buf = w.clone(), None
    for g in grads:
        wn, gn = w.norm(), g.norm()
        ratio = eeta * wn / (gn + weight_decay * wn + epsilon) if wn > 0 and gn > 0 else 1.0
        ratio = min(max(float(ratio), 0.0), 50.0)
        d = (g + weight_decay * w).clamp(-10, 10)
        if momentum:
            buf = d.clone() if buf is None else momentum * buf + d
            d = buf
        w = w - lr * ratio * d
    return w


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.5, momentum=0.9, eeta=0.1),
                                dict(lr=0.1, weight_decay=0.1, epsilon=1e-3, eeta=1.0)],
                         ids=str)
def test_lars_is_colossal_ais(kw):
    from meshlab.booster.nn.optimizer import Lars

    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, 5, generator=g, dtype=torch.float64)
    grads = [30 * torch.randn(7, 5, generator=g, dtype=torch.float64) for _ in range(4)]
    p = nn.Parameter(w0.clone())
    opt = Lars([p], **kw)
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), _colossal_lars(w0, grads, **kw), atol=1e-13,
                               rtol=1e-12)


def test_adafactor_scales_by_eps_as_colossal_ai_does():
    """Colossal-AI's RMS stays 0: with scale_parameter the relative step is scaled by
    eps[1]; a given lr is ignored under relative_step."""
    from transformers.optimization import Adafactor as Library

    from meshlab.booster.nn.optimizer import Adafactor

    g = torch.Generator().manual_seed(0)
    w0 = 5 * torch.randn(6, 4, generator=g, dtype=torch.float64)
    grad = torch.randn(6, 4, generator=g, dtype=torch.float64)
    p, q = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    Adafactor([p], lr=0.5)                      # accepted (and ignored), as Colossal-AI
    ours = Adafactor([p])
    lib = Library([q], lr=1e-2 * 1e-3, scale_parameter=False, relative_step=False)
    p.grad, q.grad = grad.clone(), grad.clone()
    ours.step()
    lib.step()
    torch.testing.assert_close(p.detach(), q.detach(), atol=1e-15, rtol=1e-13)
    assert ours.state[p]["RMS"] == 0


def test_setup_distributed_accepts_the_plugins_arguments():
    from meshlab.booster.nn import optimizer

    for name in ("DistributedLamb", "DistributedAdaFactor", "DistributedCAME"):
        if not _available(name):
            continue
        opt = getattr(optimizer, name)([nn.Parameter(torch.ones(2, 2))],
                                       **({} if "Ada" in name else {"lr": 1e-3}))
        assert opt.setup_distributed(tp_group=None, dp_group=None, shard_to_working_param={},
                                     padding_map=None, use_zero=True) is None
        assert opt.setup_distributed(None, None, {}, None, is_zero=True) is None
    if _available("DistributedLamb"):
        lamb = optimizer.DistributedLamb([nn.Parameter(torch.ones(2))])
        assert lamb.defaults["bias_correction"] is True       # Colossal-AI's default there


def test_eight_bit_galore_is_refused_by_name():
    from meshlab.booster.nn import optimizer
    from meshlab.core.errors import ConfigError

    for name in ("DistGaloreAwamW", "GaLoreAdamW8bit"):
        with pytest.raises(ConfigError, match=f"{name}: meshlab does not provide"):
            getattr(optimizer, name)([nn.Parameter(torch.ones(2))], lr=1e-3)


@pytest.mark.parametrize("name,module,extra", [("CAME", "came_pytorch", "optim"),
                                               ("GaLoreAdamW", "galore_torch", "galore"),
                                               ("GaLoreAdamW", "bitsandbytes", "galore")])
def test_a_missing_library_names_its_extra(monkeypatch, name, module, extra):
    import sys

    from meshlab.booster import _colossal_optims
    from meshlab.booster.nn import optimizer
    from meshlab.core.log import MissingExtraError

    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setattr(_colossal_optims, "_BUILT", {})
    with pytest.raises(MissingExtraError, match=rf"pip install 'meshlab\[{extra}\]'"):
        getattr(optimizer, name)
