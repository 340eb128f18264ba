"""Optimizers that are not elementwise under tensor parallelism by specs and ZeRO-3 (FSDP2)
on 2 gloo ranks.

* Muon (its Newton-Schulz orthogonalization of each weight matrix): the parameters are
  DTensors, whose ops compute over the whole matrix, so three steps give one process's
  weights. torch's Muon orthogonalizes in bfloat16, whose rounding follows the order of
  the sums (tensor parallelism splits them): 0.5% of a weight apart after three steps at
  tp=2, as any split of the products would be. The same iteration in float32 (patched in on
  both sides) shows the layouts exact, to 1e-5.
* Adafactor: DTensor cannot compute its factored moment (an in-place square of a pending
  norm), so it is refused by name on DTensor parameters before any step, where torch
  stopped inside the update.
* Under ZeRO-1, where the optimizer steps flat slices, both are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH = 3, 8


class Net(nn.Module):
    """Weight matrices only (Muon steps 2-D parameters)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16, bias=False)
        self.out = nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


OPTIMIZERS = {"muon": (torch.optim.Muon, dict(lr=2e-2))}


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon iteration (torch/optim/_muon.py) in float32 instead of bfloat16."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def case_optimizers(rank, world):
    import torch.optim._muon as muon

    import meshlab as ml
    from meshlab import P
    from meshlab.core.errors import ConfigError

    muon._zeropower_via_newtonschulz = _newton_schulz_fp32
    torch.manual_seed(0)
    base = Net()
    data, target = torch.randn(STEPS, BATCH, 8), torch.randn(STEPS, BATCH, 4)
    layouts = {"tp": (ml.shard({"inp.weight": P("tp", None), "out.weight": P(None, "tp")}),
                      ml.Mesh(tp=2), False),
               "zero3": (ml.zero_shard(3, "dp"), ml.Mesh(dp=2), True)}
    for oname, (cls, kw) in OPTIMIZERS.items():
        ref = Net()
        ref.load_state_dict(base.state_dict())
        ref_opt = cls(ref.parameters(), **kw)
        for s in range(STEPS):
            nn.functional.mse_loss(ref(data[s]), target[s]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for lname, (spec, mesh, split) in layouts.items():
            model = Net()
            model.load_state_dict(base.state_dict())
            model = ml.parallelize(model, spec, mesh)
            opt = ml.optimizer(model, cls, **kw)
            mine = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2) if split else slice(None)
            for s in range(STEPS):
                nn.functional.mse_loss(model(data[s, mine]), target[s, mine]).backward()
                opt.step()
                opt.zero_grad()
            for n, p in ref.named_parameters():
                got = _full(dict(model.named_parameters())[n]).detach()
                torch.testing.assert_close(got, p.detach(), atol=1e-5, rtol=1e-4,
                                           msg=f"{oname} under {lname}: {n}")
    for cls, kw in OPTIMIZERS.values():
        model = ml.parallelize(Net(), ml.zero_shard(1, "dp"), ml.Mesh(dp=2))
        with pytest.raises(ConfigError, match=f"{cls.__name__} under Zero"):
            ml.optimizer(model, cls, **kw)
    for spec, mesh, _ in layouts.values():
        model = ml.parallelize(Net(), spec, mesh)
        with pytest.raises(ConfigError, match="Adafactor on DTensor parameters"):
            ml.optimizer(model, torch.optim.Adafactor, lr=1e-2)
    return True


def test_non_elementwise_optimizers_train_as_one_process(world2):
    assert world2.run(case_optimizers) == [True, True]
