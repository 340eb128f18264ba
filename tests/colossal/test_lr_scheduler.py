"""Colossal-AI's learning-rate schedulers, on one process.

Covers ``tests/test_checkpoint_io/test_general_checkpoint_io.py::test_unsharded_checkpoint``
(a second ``CosineAnnealingWarmupLR`` is built on the optimizer the first one already
stepped; the optimizer's state must then equal a fresh optimizer's loaded from the saved
file, so building the scheduler must leave the decayed rate where it is) and
``tests/test_optimizer/test_lr_scheduler.py`` (a warm-up scheduler's state loads into
another and saves back equal, step after step). Colossal-AI's cosine and multi-step
schedules are torch's recursive ``CosineAnnealingLR`` and ``MultiStepLR`` behind a warm-up
or flat phase; the cases below pin what that means against values written out by hand.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn


def test_a_scheduler_built_on_a_decayed_optimizer_keeps_its_rate(tmp_path):
    from meshlab.booster.checkpoint_io import GeneralCheckpointIO
    from meshlab.booster.nn.lr_scheduler import CosineAnnealingWarmupLR

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = CosineAnnealingWarmupLR(opt, total_steps=10)
    assert opt.param_groups[0]["lr"] == 1e-3             # no warm-up: step 0 is the rate
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    sched.step()
    decayed = 1e-3 * (1 + math.cos(math.pi / 10)) / 2
    assert math.isclose(opt.param_groups[0]["lr"], decayed, rel_tol=1e-12)
    io = GeneralCheckpointIO()
    io.save_optimizer(opt, tmp_path / "optim")
    io.save_lr_scheduler(sched, tmp_path / "sched")

    new_model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    new_opt = torch.optim.Adam(new_model.parameters(), lr=1e-3)
    # as Colossal-AI's test does: the new scheduler on the old optimizer
    new_sched = CosineAnnealingWarmupLR(opt, total_steps=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(decayed, rel=1e-12)
    io.load_optimizer(new_opt, tmp_path / "optim")
    io.load_lr_scheduler(new_sched, tmp_path / "sched")
    assert new_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # and the rebuilt scheduler goes on from where the saved one was
    opt.step()
    new_sched.step()
    assert math.isclose(opt.param_groups[0]["lr"],
                        1e-3 * (1 + math.cos(2 * math.pi / 10)) / 2, rel_tol=1e-12)


def _sgd(lr=1.0):
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


def _decayed():
    """An SGD whose rate went from 1.0 to 0.25 under a scheduler of its own."""
    opt = _sgd()
    first = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.step()
        first.step()
    assert opt.param_groups[0]["lr"] == 0.25 and opt.param_groups[0]["initial_lr"] == 1.0
    return opt


def test_each_schedule_starts_on_a_decayed_optimizer_where_colossal_ais_does():
    """torch's recursive schedules (cosine, multi-step), alone or with neither warm-up nor
    flat phase in front, keep the rate; a warm-up, a flat phase, a closed form, or
    FlatAnnealingWarmupLR's restart at the cosine start from the base rate (1.0)."""
    from meshlab.booster.nn import lr_scheduler as L

    keeps = {"CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, total_steps=10),
             "CosineAnnealingWarmupLR": lambda o: L.CosineAnnealingWarmupLR(o, 10),
             "FlatAnnealingLR(pct_start=0)": lambda o: L.FlatAnnealingLR(o, 10, pct_start=0.0),
             "MultiStepLR": lambda o: L.MultiStepLR(o, 10, milestones=[4]),
             "MultiStepWarmupLR(warmup_steps=0)":
                 lambda o: L.MultiStepWarmupLR(o, 10, milestones=[4])}
    starts = {"CosineAnnealingWarmupLR(warmup_steps=2)":
                  (lambda o: L.CosineAnnealingWarmupLR(o, 10, warmup_steps=2), 0.5),
              "FlatAnnealingLR": (lambda o: L.FlatAnnealingLR(o, 10), 1.0),
              "FlatAnnealingWarmupLR": (lambda o: L.FlatAnnealingWarmupLR(o, 10, pct_start=0.0),
                                        1.0),
              "LinearWarmupLR": (lambda o: L.LinearWarmupLR(o, 10, warmup_steps=1), 0.5),
              "PolynomialWarmupLR": (lambda o: L.PolynomialWarmupLR(o, 10), 1.0)}
    for name, make in keeps.items():
        opt = _decayed()
        make(opt)
        assert opt.param_groups[0]["lr"] == 0.25, name
    for name, (make, lr) in starts.items():
        opt = _decayed()
        make(opt)
        assert opt.param_groups[0]["lr"] == lr, name
    # and the cosine goes on from the kept rate: step 1 of 10 scales it as torch's does
    opt = _decayed()
    s = L.CosineAnnealingWarmupLR(opt, 10)
    opt.step()
    s.step()
    assert math.isclose(opt.param_groups[0]["lr"], 0.25 * (1 + math.cos(math.pi / 10)) / 2,
                        rel_tol=1e-12)


def test_the_hand_over_after_the_warm_up():
    """After the warm-up the inner schedule starts at its step 0 from the base rate: the
    cosine at its top, a milestone at the warm-up's end decays right there, once."""
    from meshlab.booster.nn.lr_scheduler import MultiStepWarmupLR

    opt = _sgd()
    s = MultiStepWarmupLR(opt, total_steps=10, warmup_steps=2, milestones=[2, 5], gamma=0.5)
    got = []
    for _ in range(7):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    assert got == [0.5, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert s.last_epoch == 7 and s.after_scheduler.last_epoch == 5


def test_a_warmup_schedulers_state_loads_and_saves_back_equal():
    """Colossal-AI's test_lr_scheduler_save_load: two schedulers on one optimizer, the
    first's state loaded into the second after every step saves back equal; here through
    JSON (what Booster.save_lr_scheduler writes), and the loaded one steps on alike."""
    from meshlab.booster.nn.lr_scheduler import CosineAnnealingWarmupLR, FlatAnnealingWarmupLR
    from meshlab.core.errors import ConfigError

    for make in (lambda o: CosineAnnealingWarmupLR(o, total_steps=5, warmup_steps=2),
                 lambda o: FlatAnnealingWarmupLR(o, total_steps=8, warmup_steps=2)):
        opt = torch.optim.Adam(nn.Linear(10, 10).parameters(), lr=1e-3)
        scheduler, new_scheduler = make(opt), make(opt)
        for _ in range(5):
            opt.step()
            scheduler.step()
            state = json.loads(json.dumps(scheduler.state_dict()))
            new_scheduler.load_state_dict(state)
            assert new_scheduler.state_dict() == scheduler.state_dict()
        assert new_scheduler.after_scheduler.last_epoch == scheduler.after_scheduler.last_epoch
        lr = opt.param_groups[0]["lr"]
        opt.step()
        scheduler.step()
        after_one = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = lr
        new_scheduler.step()
        assert opt.param_groups[0]["lr"] == after_one
    with pytest.raises(ConfigError, match="after_scheduler_dict"):
        new_scheduler.load_state_dict({"last_epoch": 3})


def test_colossal_ais_arguments_and_refusals():
    """total_steps comes second everywhere (torch's StepLR(opt, 100) would decay every 100
    steps; Colossal-AI's decays every step); what cannot run is refused by name."""
    from meshlab.booster.nn import lr_scheduler as L
    from meshlab.core.errors import ConfigError

    opt = _sgd()
    s = L.StepLR(opt, 100)
    assert s.step_size == 1 and s.gamma == 0.1
    assert L.ExponentialLR(_sgd(), 100).gamma == 1.0
    opt = _sgd()
    L.LambdaLR(opt, 100, lr_lambda=lambda t: 0.5 ** t)
    opt.step()
    L.MultiplicativeLR(_sgd(), 100, lr_lambda=lambda t: 0.9)
    opt = _sgd(0.4)
    one = L.OneCycleLR(opt, total_steps=10)
    assert one.total_steps == 10 and opt.param_groups[0]["max_lr"] == 0.4
    for make, fix in ((lambda: L.LambdaLR(_sgd(), 100), "lr_lambda=lambda step"),
                      (lambda: L.MultiStepWarmupLR(_sgd(), 10, warmup_steps=2),
                       "milestones=\\[30, 60\\]"),
                      (lambda: L.FlatAnnealingLR(_sgd(), 4, pct_start=2), "in \\[0, 1\\]")):
        with pytest.raises(ConfigError, match=fix):
            make()
    # a cosine phase of no steps: built and stepped through the warm-up or flat phase as
    # Colossal-AI's is; a step past it (torch would divide by 0) names the fix
    for make, fix in ((lambda o: L.CosineAnnealingWarmupLR(o, 4, warmup_steps=4),
                       "warmup_steps < total_steps"),
                      (lambda o: L.FlatAnnealingLR(o, 4, pct_start=1.0), "pct_start < 1")):
        opt = _sgd()
        s = make(opt)
        for _ in range(4):
            opt.step()
            s.step()
        assert opt.param_groups[0]["lr"] == 1.0
        with pytest.raises(ConfigError, match=fix):
            s.step()
