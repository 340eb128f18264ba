"""A remote-code family (trust_remote_code) under a policy its user writes and registers.

``_remote_code`` writes a tiny ChatGLM-like model directory (config.json with an
``auto_map``, its configuration and modeling modules); transformers builds it from those
local files with ``trust_remote_code=True``, and a policy written outside meshlab,
registered for ``model_type`` ``tinyglm``, shards it. The parity cases train it three
AdamW steps single-process and on 4 gloo processes (``tp_zero3``: dp=2 x tp=2 with
ZeRO-3; ``tp``: tensor parallelism alone) and compare losses, gradients and weights.

Every rank builds the model itself from the directory, importing the copies of its code
that the test process put in a shared ``HF_MODULES_CACHE``. Registration lasts for a
case only: the registry is as it was after each.
"""

from __future__ import annotations

import os
import sys

import pytest

import meshlab as ml

from tests import _models as M
from tests import _remote_code as RC

pytestmark = pytest.mark.timeout(600)

QKV = "transformer.encoder.layers.0.self_attention.query_key_value.weight"


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """The model directories and the modules cache their code is imported from, filled
    here once so that the ranks only read it."""
    import transformers.dynamic_module_utils as dmu

    root = tmp_path_factory.mktemp("remote_code")
    cache, before, env = root / "modules", dmu.HF_MODULES_CACHE, os.environ.get("HF_MODULES_CACHE")
    RC.use_modules_cache(cache)
    dirs = {"mq": RC.write(root / "tinyglm"),                            # 4 groups, 4 heads
            "per_head": RC.write(root / "tinyglm_per_head", multi_query_attention=False),
            "groups2": RC.write(root / "tinyglm_groups2", multi_query_group_num=2)}
    for d in dirs.values():
        RC.load(d)
    yield {k: str(v) for k, v in dirs.items()}, str(cache)
    dmu.HF_MODULES_CACHE = before
    if env is None:
        os.environ.pop("HF_MODULES_CACHE", None)
    else:
        os.environ["HF_MODULES_CACHE"] = env
    for name in [n for n in sys.modules if n.split(".")[0] == "transformers_modules"]:
        del sys.modules[name]
    if str(cache) in sys.path:
        sys.path.remove(str(cache))


def _plan(path, pol, spec_name="tp_zero3"):
    with RC.registered(pol):
        return ml.plan(RC.load(path), M.spec(spec_name), ml.Mesh(dp=2, tp=2, fake=True))


@pytest.mark.parametrize("spec_name", ["tp_zero3", "tp"])
def test_parity(world4, remote, spec_name):
    dirs, cache = remote
    out = world4.run(RC.parity, path=dirs["mq"], cache=cache, spec_name=spec_name)
    assert all(o["losses"] == out[0]["losses"] for o in out)
    assert "tinyglm" not in ml.policies.registered()


def test_per_head_parity(world4, remote):
    dirs, cache = remote
    out = world4.run(RC.parity, path=dirs["per_head"], cache=cache, spec_name="tp_zero3",
                     pol="PER_HEAD")
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_mlp_only_parity(world4, remote):
    """Two K/V groups for four heads: attention whole, the MLP split."""
    dirs, cache = remote
    out = world4.run(RC.parity, path=dirs["groups2"], cache=cache, spec_name="tp",
                     pol="MLP_ONLY")
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_a_wrong_split_fails_parity(world4, remote):
    dirs, cache = remote
    with pytest.raises(AssertionError, match="grad of transformer"):
        world4.run(RC.parity, path=dirs["mq"], cache=cache, spec_name="tp", pol="WRONG_SPLIT")
    assert _plan(dirs["mq"], RC.WRONG_SPLIT)[QKV].mesh_spec == ml.P("tp", None)


def test_policy_lays_out_what_it_says(remote):
    from meshlab.transforms.shard._layout import tp_layout

    dirs, _ = remote
    plan = _plan(dirs["mq"], RC.POLICY)
    assert plan.model.cls == "TinyGLMForCausalLM" and plan.model.base_prefix == "transformer"
    e = plan[QKV]
    assert e.mesh_spec == ml.P("tp", None) and "packed_qkv_colwise" in e.tags
    layout, _ = tp_layout(plan, 1)
    attn = "transformer.encoder.layers.0.self_attention"
    assert {(attn, "num_attention_heads_per_partition", 2),
            (attn, "num_multi_query_groups_per_partition", 2),
            (f"{attn}.core_attention", "hidden_size_per_partition", 16)} <= set(layout.attrs)
    assert _plan(dirs["groups2"], RC.MLP_ONLY)[QKV].mesh_spec == ml.P()
    assert "tinyglm" not in ml.policies.registered()


def test_without_a_policy_auto_says_how_to_register_one(remote):
    dirs, _ = remote
    rules = ml.Rules(**M.TP_RULES)
    with pytest.raises(ml.PolicyError) as ei:
        ml.plan(RC.load(dirs["mq"]), ml.shard(ml.policies.auto, rules),
                ml.Mesh(dp=2, tp=2, fake=True))
    msg = str(ei.value)
    assert "'tinyglm'" in msg and "no base_model_tp_plan" in msg
    assert "meshlab.policies.register('tinyglm', Policy(...))" in msg
    assert "Remote-code models" in msg


def test_unequal_packed_parts_are_refused(remote):
    # ChatGLM2's layout: q of 4 heads, then k and v of 2 groups each (64 features);
    # three equal cuts would mix queries with keys
    dirs, _ = remote
    with pytest.raises(ml.ConfigError, match=r"query_key_value\.weight \(64, 32\): "
                                             r"packed_qkv_colwise splits three equal parts"):
        _plan(dirs["groups2"], RC.POLICY)
    with pytest.raises(ml.ConfigError, match="no integer attribute "
                                             "'num_multi_query_groups_per_partition'"):
        _plan(dirs["per_head"], RC.POLICY)      # the policy of the other layout
    assert "tinyglm" not in ml.policies.registered()
