"""``offload`` at plan time: typed refusals before anything runs, the selection, what
``plan.memory()`` and ``step_cost`` say, ``policy='auto'``, and ``meshlab plan --offload``."""

from __future__ import annotations

import pytest

import meshlab as ml
from meshlab.policies import presets
from meshlab.transforms.offload import OffloadBudgetError

from tests import _models as M


def _plan(spec, mesh=None):
    return ml.plan(M.build("llama", vocab_size=96), spec, mesh or ml.Mesh(dp=2, fake=True))


@pytest.mark.parametrize("kw,needle", [
    (dict(optimizer=1.5), "from 0 to 1"),
    (dict(optimizer=-0.1), "finite number >= 0"),
    (dict(optimizer=True), "not a bool"),
    (dict(optimizer="half"), "not a bool, string"),
    (dict(params=0.5), "params <= grads <= optimizer"),
    (dict(grads=1.0, optimizer=0.5), "params <= grads <= optimizer"),
    (dict(policy="greedy"), "'static', 'auto'"),
    (dict(budget="80GiB"), "policy='auto'"),
    (dict(policy="auto", budget="lots"), "is not a size"),
    (dict(policy="auto", optimizer=0.5), "not both"),
])
def test_bad_arguments_are_refused_by_name(kw, needle):
    with pytest.raises(ml.ConfigError, match=None) as e:
        ml.offload(**kw)
    assert needle in str(e.value)


def test_selection_is_largest_first_and_nested():
    p = _plan(ml.zero_shard(3, "dp") | ml.offload(params=0.3, grads=0.6, optimizer=0.9))
    c = p.get(ml.parallel.Offload).choice(p)
    assert c.params <= c.grads <= c.optimizer
    assert c.reached[0] >= 0.3 and c.reached[1] >= 0.6 and c.reached[2] >= 0.9
    sizes = {e.fqn: e.numel for e in p.params}
    biggest = max(sizes, key=sizes.get)
    assert biggest in c.optimizer
    assert c.units and all(any(f.startswith(u) for f in c.params) for u in c.units if u)


def test_memory_moves_to_the_host():
    none = _plan(ml.zero_shard(3, "dp")).memory()
    full = _plan(ml.zero_shard(3, "dp") | ml.offload(params=1.0, grads=1.0,
                                                     optimizer=1.0)).memory()
    assert none.host == 0 and full.total == 0
    assert full.host == pytest.approx(none.total, rel=0.01)
    half = _plan(ml.zero_shard(1, "dp") | ml.offload(optimizer=0.5)).memory()
    z1 = _plan(ml.zero_shard(1, "dp")).memory()
    assert 0 < half.host < z1.total and half.total < z1.total
    assert "host total" in str(half)


def test_refusals_name_the_fix():
    with pytest.raises(ml.ConfigError, match="data_parallel and every zero_shard stage "
                                             "build"):
        ml.plan(M.build("llama"), ml.offload(params=1.0, grads=1.0, optimizer=1.0),
                ml.Mesh(dp=1, fake=True))
    assert _plan(ml.data_parallel("dp") | ml.offload(params=1.0, grads=1.0,
                                                     optimizer=1.0)).runnable
    for stage in (1, 2):
        p = _plan(ml.zero_shard(stage, "dp") | ml.offload(params=1.0, grads=1.0, optimizer=1.0))
        assert p.runnable and not p.not_runnable
    # gradients summed after the backward (ZeRO-1's reduce-scatter) leave at the step
    p = _plan(ml.zero_shard(1, "dp") | ml.offload(grads=1.0, optimizer=1.0))
    assert p.runnable and not p.not_runnable
    # beside tensor parallelism it composes (the table's shard x offload cells)
    p = _plan(ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | ml.offload(optimizer=1.0),
              ml.Mesh(dp=1, tp=2, fake=True))
    assert p.runnable and not p.not_runnable


def test_auto_fits_the_budget_or_names_the_smallest():
    big = presets.build("llama3-8b", device="meta")
    mesh = ml.Mesh(dp=1, fake=True)
    p = ml.plan(big, ml.precision("bf16") | ml.offload(policy="auto", budget="60GiB"), mesh)
    c = p.get(ml.parallel.Offload).choice(p)
    assert 0 < c.fractions[2] < 1 and "auto:" in c.auto
    assert p.memory().total <= 60 * 2**30
    with pytest.raises(OffloadBudgetError, match="smallest budget that works is"):
        ml.plan(big, ml.precision("bf16") | ml.offload(policy="auto", budget="4GiB"), mesh)


def test_step_cost_from_the_shipped_profile():
    big = presets.build("llama3-8b", device="meta")
    p = ml.plan(big, ml.precision("bf16") | ml.offload(optimizer=1.0), ml.Mesh(dp=1, fake=True))
    cost = p.get(ml.parallel.Offload).step_cost(p)
    assert cost.host_elements == sum(e.numel for e in p.params)
    assert cost.d2h_bytes == cost.h2d_bytes == 2 * cost.host_elements      # bf16 both ways
    assert cost.profile is not None and 0.5 < cost.seconds < 10
    assert "predicted offload time per step" in str(cost)


def test_cli_prints_host_rows_and_cost(capsys):
    from meshlab.cli import main

    assert main(["plan", "--model", "llama3-8b", "--mesh", "dp=1", "--offload",
                 "optimizer=1.0"]) == 0
    out = capsys.readouterr().out
    assert "host optimizer" in out and "predicted offload time per step" in out
    assert main(["plan", "--model", "llama3-8b", "--mesh", "dp=1", "--offload", "opt=1"]) == 2
