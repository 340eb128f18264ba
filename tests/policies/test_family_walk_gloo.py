"""The family walk: every Hugging Face family whose config carries a ``base_model_tp_plan``
runs one parity step at tp=2 on two gloo processes (``meshlab.testing.walk``), and the
outcome equals what meshlab ships in ``meshlab/policies/support.json`` — the data
``policies.auto`` lets through or refuses with its reason. A family is supported because
this run trained it, never because its plan translates."""

from __future__ import annotations

import collections

import pytest
import torch
import transformers

import meshlab as ml
from meshlab.policies import _support
from meshlab.testing import walk
from meshlab.testing.tiny import build as meta

pytestmark = pytest.mark.timeout(900)


def walk_case(rank, world, families):
    return {mt: walk.check_family(rank, world, mt) for mt in families}


def test_walk_decides_what_meshlab_ships(world2):
    shipped = _support.load()
    if shipped["transformers"] != transformers.__version__:
        pytest.fail(f"support.json was walked on transformers {shipped['transformers']}, "
                    f"this is {transformers.__version__}: run scripts/support_table.py")
    families = walk.tp_plan_families()
    assert families == sorted(shipped["families"]), "families with a tp plan changed"
    results = world2.run(walk_case, timeout=600, families=families)
    assert results[0] == results[1], "the two ranks decided differently"
    counts = collections.Counter(o["outcome"] for o in results[0].values())
    print(f"\nfamily walk over {len(families)} tp plans: {dict(counts)}")
    differ = {mt: (o["outcome"], shipped["families"][mt]["outcome"])
              for mt, o in results[0].items()
              if o["outcome"] != shipped["families"][mt]["outcome"]}
    assert not differ, f"walk (now, shipped) differ: {differ}"
    assert counts["trained"] >= 60


def test_auto_refuses_what_the_walk_did_not_train():
    import re

    fams = _support.load()["families"]
    rules = ml.Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
    # refused at bind: a replicated weight whose gradient tensor parallelism leaves partial
    refused = [mt for mt, o in sorted(fams.items()) if o["outcome"] == "refused"
               and o["reason"].startswith("ConfigError")
               and "replicated, but under tensor parallelism" in o["reason"]]
    assert refused, "the walk refuses some layouts at bind"
    mt = refused[0]
    reason = fams[mt]["reason"].removeprefix("ConfigError: ")[:40]
    with pytest.raises(ml.PolicyError, match=re.escape(mt) + ".*refused.*" + re.escape(reason)):
        ml.plan(meta(mt), ml.shard(ml.policies.auto, rules), ml.Mesh(tp=2, fake=True))
    # the translated plan itself is refused at bind for the same reason
    with pytest.raises(ml.ConfigError, match=re.escape(reason)):
        ml.plan(meta(mt), ml.shard(ml.policies.get(mt, dict(meta(mt).config.base_model_tp_plan)),
                                   rules), ml.Mesh(tp=2, fake=True))
    p = ml.plan(meta("llama"), ml.shard(ml.policies.auto, rules), ml.Mesh(tp=2, fake=True))
    assert "tp" in p["model.layers.0.self_attn.q_proj.weight"].mesh_spec.axes


def test_auto_refuses_a_family_that_trained_differently(monkeypatch):
    """A walk outcome other than trained (here one that ran and mismatched) is refused by
    auto with the outcome and its reason."""
    fams = _support.load()["families"]
    monkeypatch.setitem(fams, "qwen2", {"outcome": "mismatch",
                                        "reason": "gradient of x off by 0.5"})
    rules = ml.Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
    with pytest.raises(ml.PolicyError, match="mismatch.*gradient of x off by 0.5"):
        ml.plan(meta("qwen2"), ml.shard(ml.policies.auto, rules), ml.Mesh(tp=2, fake=True))


def test_auto_refuses_a_family_the_walk_never_saw(monkeypatch):
    monkeypatch.delitem(_support.load()["families"], "llama")
    rules = ml.Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
    with pytest.raises(ml.PolicyError, match="'llama' was not in meshlab's family walk"):
        ml.plan(meta("llama"), ml.shard(ml.policies.auto, rules), ml.Mesh(tp=2, fake=True))


def test_float32_tolerance_judges_sign_flipped_updates_by_their_gradient():
    """Adam's first update is lr·sign(g) where |g| >> eps: a gradient within rounding of
    zero may flip it, which the walk leaves to the gradient check; a wrong update on any
    other element is still caught."""
    ref, model = torch.nn.Linear(4, 1, bias=False), torch.nn.Linear(4, 1, bias=False)
    g = torch.tensor([[1e-2, -3e-3, 2e-9, 5e-2]])
    model.weight.data = ref.weight.data.clone()
    loss = torch.tensor(1.0)
    model.weight.data[0, 2] += 2e-3          # the sign flip of a near-zero gradient
    assert walk._compare(loss, {"weight": g}, model, loss, {"weight": g}, ref,
                         walk.TOLS_FP32) is None
    model.weight.data[0, 0] += 1e-3          # one lr on a well-defined update
    bad = walk._compare(loss, {"weight": g}, model, loss, {"weight": g}, ref, walk.TOLS_FP32)
    assert bad is not None and bad.startswith("weight weight off by 0.001")
