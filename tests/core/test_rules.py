"""Rules: logical axis names -> mesh axes with ordered fallbacks."""

from __future__ import annotations

import json

import pytest

import meshlab as ml
from meshlab import LOGICAL_AXES, P, Rules, RulesError, SpecError, first, presets
from meshlab.core.context import current_rules

AXES = ("dp", "tp")
TINY_MESH = ml.Mesh(dp=2, tp=2, fake=True)


# ---------------------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------------------

def test_single_rule_maps_to_axis():
    r = Rules(batch="dp", mlp="tp")
    assert r.resolve(P("batch", "mlp"), AXES) == P("dp", "tp")
    assert r.resolve(P("mlp", None, "batch"), AXES) == P("tp", None, "dp")


def test_first_present_fallback_wins():
    r = Rules(embed=first("fsdp", "tp", "dp"))
    # 'fsdp' is not in the mesh: the next one present wins
    assert r.resolve(P("embed"), AXES) == P("tp")
    assert r.resolve(P("embed"), ("fsdp", "tp")) == P("fsdp")
    assert r.resolve(P("embed"), ("dp",)) == P("dp")
    # none present: the rule names only absent axes, which raises (see the typo tests);
    # a final None replicates instead
    with pytest.raises(RulesError):
        r.resolve(P("embed"), ("pp",))
    assert Rules(embed=("fsdp", "tp", "dp", None)).resolve(P("embed"), ("pp",)) == P(None)


def test_first_unused_fallback_wins():
    r = Rules(batch=("dp",), mlp="tp", embed=first("dp", "tp"))
    # batch's rule takes 'dp', so embed falls back to 'tp'
    assert r.resolve(P("batch", "embed"), AXES) == P("dp", "tp")
    # embed takes 'dp' itself
    assert r.resolve(P("embed", "mlp"), AXES) == P("dp", "tp")
    # mlp takes 'tp'; embed wanted dp or tp: dp
    assert r.resolve(P("mlp", "embed"), AXES) == P("tp", "dp")
    # both taken by earlier rules: replicate
    assert r.resolve(P("batch", "mlp", "embed"), AXES) == P("dp", "tp", None)


def test_doc_example():
    rules = Rules(batch=("dp",), mlp="tp", embed=first("fsdp", "tp"))
    assert rules.resolve(P("batch", "embed"), AXES) == P("dp", "tp")
    assert rules.resolve(P("mlp", "embed"), AXES) == P("tp", None)


def test_tuple_alternative_shards_over_two_axes():
    r = Rules(batch="dp", embed=first(("dp", "tp"), "tp"))
    assert r.resolve(P("embed"), AXES) == P(("dp", "tp"))
    assert r.resolve(P(None, "embed"), AXES) == P(None, ("dp", "tp"))
    # 'dp' taken by batch: the pair cannot be used, the single fallback can
    assert r.resolve(P("batch", "embed"), AXES) == P("dp", "tp")
    # a pair needs both axes present
    assert r.resolve(P("embed"), ("tp",)) == P("tp")
    with pytest.raises(RulesError, match="'tp'"):
        r.resolve(P("embed"), ("dp",))
    assert Rules(embed=(("dp", "tp"), "tp", None)).resolve(P("embed"), ("dp",)) == P(None)


def test_tuple_entry_of_logical_names_concatenates():
    r = Rules(batch="dp", seq="tp")
    assert r.resolve(P(("batch", "seq")), AXES) == P(("dp", "tp"))


def test_partial_resolves():
    r = Rules(mlp="tp")
    assert r.resolve(P("dp", partial="mlp"), AXES) == P("dp", partial="tp")


@pytest.mark.parametrize("name", LOGICAL_AXES)
def test_vocabulary_names_without_rules_replicate(name):
    assert Rules().resolve(P(name), AXES) == P()
    assert Rules(other_name="tp").resolve(P("dp", name), AXES) == P("dp", None)


def test_unknown_name_raises_naming_it():
    with pytest.raises(SpecError, match="'hiddn'") as ei:
        Rules(embed="tp").resolve(P("batch", "hiddn"), AXES, what="layer.weight")
    msg = str(ei.value)
    assert "layer.weight" in msg
    assert "dp" in msg and "tp" in msg          # lists the mesh axes


def test_module_level_resolve_without_rules():
    from meshlab.core.rules import resolve

    assert resolve(P("dp", "tp"), AXES, None) == P("dp", "tp")
    with pytest.raises(SpecError, match="'sp'"):
        resolve(P("sp"), AXES, None)


def test_mesh_axes_pass_through():
    r = Rules(batch="dp")
    assert r.resolve(P("tp", "batch"), AXES) == P("tp", "dp")
    assert r.resolve(P("dp", "tp"), AXES) == P("dp", "tp")


def test_mesh_axes_are_claimed_first():
    # 'embed' would take 'dp', but dim 1 names 'dp' directly: embed must fall back
    r = Rules(embed=first("dp", "tp"))
    assert r.resolve(P("embed", "dp"), AXES) == P("tp", "dp")
    # and if nothing is left, embed replicates rather than steal the named axis
    assert Rules(embed="dp").resolve(P("embed", "dp"), AXES) == P(None, "dp")
    # a named axis in partial is claimed too
    assert Rules(embed=first("tp", "dp")).resolve(P("embed", partial="tp"), AXES) == \
        P("dp", partial="tp")


def test_rule_value_none_replicates():
    assert Rules(embed=None).resolve(P("embed"), AXES) == P()
    assert Rules(embed=()).resolve(P("embed"), AXES) == P()


# ---------------------------------------------------------------------------------------
# construction, composition, value semantics
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {"embed": 1},
    {"embed": ("dp", 1)},
    {"embed": [()]},
    {"embed": (("dp", 2),)},
    {"embed": {"dp"}},
    {"embed": ("dp", None, "tp")},     # None ends the fallbacks
    {"embed": (None, None)},
])
def test_bad_values_raise(kw):
    with pytest.raises(RulesError):
        Rules(**kw)


def test_bad_names_raise():
    with pytest.raises(RulesError):
        Rules([("not-an-identifier", "dp")])
    with pytest.raises(RulesError):
        Rules({1: "dp"})


def test_union():
    r = Rules(batch="dp") | Rules(mlp="tp")
    assert isinstance(r, Rules)
    assert list(r) == ["batch", "mlp"]
    assert r.resolve(P("batch", "mlp"), AXES) == P("dp", "tp")
    # the same value on both sides is fine
    assert Rules(batch="dp") | Rules(batch=("dp",)) == Rules(batch="dp")
    # operands untouched
    a, b = Rules(batch="dp"), Rules(mlp="tp")
    _ = a | b
    assert "mlp" not in a and "batch" not in b


def test_union_with_non_rules():
    with pytest.raises(TypeError):
        Rules(batch="dp") | {"mlp": "tp"}


@pytest.mark.parametrize("left, right, first, second", [
    (Rules(mlp="tp"), Rules(mlp="dp"), "'tp'", "'dp'"),
    (Rules(mlp=None), Rules(mlp="dp"), "None", "'dp'"),
    (Rules(mlp=first("fsdp", "tp")), Rules(mlp="tp"), "('fsdp', 'tp')", "'tp'"),
])
def test_conflicting_union_raises_with_both_values(left, right, first, second):
    with pytest.raises(RulesError) as ei:
        left | right
    msg = str(ei.value)
    assert "'mlp'" in msg
    assert first in msg and second in msg


def test_duplicate_keys_in_constructor():
    with pytest.raises(RulesError) as ei:
        Rules([("mlp", "tp"), ("mlp", "dp")])
    assert "'tp'" in str(ei.value) and "'dp'" in str(ei.value)
    with pytest.raises(RulesError):
        Rules({"mlp": "tp"}, mlp="dp")
    # the same value twice is allowed
    assert Rules([("mlp", "tp")], mlp=("tp",)) == Rules(mlp="tp")


def test_rules_are_immutable():
    r = Rules(mlp="tp")
    with pytest.raises(AttributeError):
        r.mlp = "dp"


@pytest.mark.parametrize("rules, text", [
    (Rules(), "Rules()"),
    (Rules(batch="dp"), "Rules(batch='dp')"),
    (Rules(batch=("dp",), embed=first("fsdp", "tp")),
     "Rules(batch='dp', embed=first('fsdp', 'tp'))"),
    (Rules(embed=None), "Rules(embed=None)"),
    (Rules(embed=first(("dp", "tp"), "tp")), "Rules(embed=first(('dp', 'tp'), 'tp'))"),
    (Rules(embed=(("dp", "tp"),)), "Rules(embed=(('dp', 'tp'),))"),
    (Rules(mlp=("tp", None)), "Rules(mlp=('tp', None))"),
    (Rules(embed=(("dp", "tp"), None)), "Rules(embed=(('dp', 'tp'), None))"),
])
def test_repr_pastes_back(rules, text):
    assert repr(rules) == text
    again = eval(repr(rules), {"Rules": Rules, "first": first})
    assert again == rules
    assert hash(again) == hash(rules)


@pytest.mark.parametrize("rules", [
    Rules(),
    Rules(batch="dp", embed=first("fsdp", "tp"), mlp=None),
    Rules(embed=first(("dp", "tp"), "tp"), vocab="tp", custom=("sp",)),
    Rules(mlp=("tp", None), embed=("fsdp", ("dp", "tp"), None)),
    Rules.default(),
])
def test_json_round_trip(rules):
    again = Rules.from_json(json.loads(json.dumps(rules.to_json())))
    assert again == rules
    assert list(again.items()) == list(rules.items())
    assert repr(again) == repr(rules)


def test_mapping_protocol():
    r = Rules(batch="dp", embed=first("fsdp", "tp"))
    assert "batch" in r and "mlp" not in r
    assert len(r) == 2
    assert r.get("embed") == (("fsdp",), ("tp",))
    assert r.get("mlp") is None


def test_use_rules_context():
    r1, r2 = Rules(batch="dp"), Rules(batch="tp")
    assert current_rules() is None
    with ml.use_rules(r1) as got:
        assert got is r1
        assert current_rules() is r1
        with ml.use_rules(r2):
            assert current_rules() is r2
        assert current_rules() is r1
    assert current_rules() is None
    with pytest.raises(RuntimeError):
        with ml.use_rules(r1):
            raise RuntimeError("boom")
    assert current_rules() is None


def test_ambient_rules_reach_visualize():
    mesh = ml.Mesh(dp=2, tp=2, fake=True)
    with ml.use_rules(Rules(batch="dp", mlp="tp")):
        view = ml.visualize((8, 4), P("batch", "mlp"), mesh, show=False)
    assert view.spec == P("dp", "tp")
    assert view.type_str == "f32[8@dp,4@tp]"


# ---------------------------------------------------------------------------------------
# a rule naming only axes the mesh lacks raises; a final None replicates
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rules, spec, missing, nearest", [
    (Rules(mlp="model"), P("mlp"), "'model'", "'tp'"),          # another name of tp
    (Rules(heads="tpp"), P("heads"), "'tpp'", "'tp'"),          # a misspelling
    (Rules(batch="db"), P("batch", None), "'db'", "'dp'"),
    (Rules(mlp=first("fsdp", "model")), P(None, "mlp"), "'model'", "'tp'"),   # no fallback fits
])
def test_rule_naming_absent_axes_raises_with_the_nearest_name(rules, spec, missing, nearest):
    with pytest.raises(RulesError) as ei:
        rules.resolve(spec, AXES, what="layer.weight")
    msg = str(ei.value)
    name = next(iter(rules))
    assert f"rule {name}=" in msg                     # the rule
    assert missing in msg                             # the missing axis
    assert "('dp', 'tp')" in msg                      # the mesh's axes
    assert f"did you mean {nearest}" in msg           # the nearest axis name
    assert "None)" in msg and "never raises" in msg   # the explicit fallback
    assert "layer.weight" in msg


def test_absent_axis_without_a_near_name_still_explains_the_fallback():
    with pytest.raises(RulesError) as ei:
        Rules(seq="sp").resolve(P("batch", "seq"), AXES)
    msg = str(ei.value)
    assert "'sp'" in msg and "did you mean" not in msg
    assert "seq=('sp', None)" in msg


def test_final_none_replicates_without_raising():
    assert Rules(mlp=("model", None)).resolve(P("mlp"), AXES) == P()
    assert Rules(mlp=("model", None)).resolve(P("mlp"), ("dp", "model")) == P("model")
    assert Rules(mlp=("fsdp", "tp", None)).resolve(P("mlp"), AXES) == P("tp")
    # (None,) is None
    assert Rules(mlp=(None,)) == Rules(mlp=None)


def test_one_present_fallback_is_enough():
    assert Rules(mlp=first("fsdp", "tp")).resolve(P("mlp"), AXES) == P("tp")
    # present but taken by an earlier dim replicates, as before: nothing is misspelled
    assert Rules(mlp="tp").resolve(P("tp", "mlp"), AXES) == P("tp", None)


def test_unused_rules_are_not_checked():
    # only the rules a spec uses are resolved against the mesh
    assert Rules(mlp="model", batch="dp").resolve(P("batch"), AXES) == P("dp")


def test_typo_in_rules_fails_the_plan():
    model = presets.build("tiny-llama")
    with pytest.raises(RulesError, match="did you mean 'tp'") as ei:
        ml.plan(model, ml.shard(ml.policies.auto, Rules(batch="dp", mlp="model")), TINY_MESH)
    assert "mlp.gate_proj.weight" in str(ei.value)
    plan = ml.plan(model, ml.shard(ml.policies.auto, Rules(batch="dp", mlp=("model", None))),
                   TINY_MESH)
    assert all(e.mesh_spec.axes == () for e in plan)   # replicated, by request
    assert plan.unused_axes() == ("tp",)


def test_nearest_axis():
    from meshlab.core.rules import KNOWN_AXES, nearest_axis

    assert nearest_axis("tq", KNOWN_AXES) == "tp"
    assert nearest_axis("tpp", ("dp", "tp")) == "tp"
    assert nearest_axis("model", ("dp", "tp")) == "tp"
    assert nearest_axis("sp", ("dp", "tp")) is None      # absent, not misspelled
    assert nearest_axis("zzz", ("dp", "tp")) is None


# ---------------------------------------------------------------------------------------
# default rules
# ---------------------------------------------------------------------------------------

def test_default_rules_value():
    from meshlab.core.rules import DEFAULT_RULES

    assert Rules.default() is DEFAULT_RULES
    d = Rules.default()
    assert set(d) == {"batch", "heads", "kv_heads", "mlp", "vocab", "embed"}
    for name in ("heads", "kv_heads", "mlp", "vocab"):
        assert d.resolve(P(name), ("dp", "tp")) == P("tp")
        assert d.resolve(P(name), ("data", "model")) == P("model")
    assert d.resolve(P("batch", "embed"), ("dp", "tp")) == P("dp", None)
    assert d.resolve(P("batch", "embed"), ("fsdp", "tp")) == P("fsdp", None)  # batch took it
    assert d.resolve(P("embed"), ("fsdp", "tp")) == P("fsdp")
    assert d.resolve(P("batch"), ("dp", "fsdp", "tp")) == P(("dp", "fsdp"))
    # every default ends in None: any mesh resolves, missing axes replicate
    for axes in (("pp",), ("sp", "ep"), ("x",)):
        for name in d:
            assert d.resolve(P(name), axes) == P()
    assert d.resolve(P("batch", "mlp", "embed"), ("dp",)) == P("dp", None, None)
    assert d.resolve(P("batch", "mlp", "embed"), ("tp",)) == P(None, "tp", None)


def test_default_rules_shard_tiny_llama_over_tp():
    model = presets.build("tiny-llama")
    plan = ml.plan(model, ml.shard(ml.policies.auto), TINY_MESH)
    ms = {e.fqn: e.mesh_spec for e in plan}
    for i in range(2):
        pre = f"model.layers.{i}."
        for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            assert ms[pre + leaf + ".weight"] == P("tp")
        for leaf in ("self_attn.o_proj", "mlp.down_proj"):
            assert ms[pre + leaf + ".weight"] == P(None, "tp")
        assert ms[pre + "input_layernorm.weight"] == P()
    assert ms["model.embed_tokens.weight"] == P("tp") == ms["lm_head.weight"]
    assert plan.rules == Rules.default()
    assert plan.roles.tp == "tp" and plan.roles.dp == ("dp",) and plan.roles.fsdp == ()
    assert plan.runnable
    # the plan (and its table's caption) says which rules were used
    assert plan.transforms == (f"shard(policies.auto) with default {Rules.default()!r}",)
    assert "with default Rules(batch=" in str(plan)
    # the transform value itself is what was written
    assert plan.options == (ml.shard(ml.policies.auto),)
    assert plan.options[0].rules is None
    assert ml.Plan.from_json(plan.to_json()) == plan


def test_default_rules_with_fsdp_shard_embed():
    model = presets.build("tiny-llama")
    plan = ml.plan(model, ml.shard(ml.policies.auto), ml.Mesh(fsdp=2, tp=2, fake=True))
    assert plan["model.layers.0.self_attn.q_proj.weight"].mesh_spec == P("tp", "fsdp")
    assert plan["model.norm.weight"].mesh_spec == P("fsdp")
    assert plan.roles.tp == "tp" and plan.roles.fsdp == ("fsdp",)


def test_default_rules_on_a_mesh_without_tp_replicate():
    model = presets.build("tiny-llama")
    plan = ml.plan(model, ml.shard(ml.policies.auto), ml.Mesh(dp=2, fake=True))
    assert all(e.mesh_spec.axes == () for e in plan)
    assert plan.roles.dp == ("dp",) and plan.runnable


def test_explicit_rules_are_used_as_given():
    model = presets.build("tiny-llama")
    rules = Rules(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab=None, embed="dp")
    spec = ml.shard(ml.policies.auto, rules)
    plan = ml.plan(model, spec, TINY_MESH)
    assert plan.rules == rules
    assert plan.transforms == (repr(spec),)
    assert "default" not in plan.transforms[0]
    assert plan["lm_head.weight"].mesh_spec == P(None, "dp")
    assert plan["model.layers.0.mlp.up_proj.weight"].mesh_spec == P("tp", "dp")
    # rules already in the plan are not replaced by the defaults either
    first = ml.shard({"lm_head.weight": P("vocab")}, Rules(vocab="tp"))
    plan = ml.plan(model, first | ml.shard({"model.norm.weight": P("embed")}), TINY_MESH)
    assert plan.rules == Rules(vocab="tp")
    assert plan["model.norm.weight"].mesh_spec == P()
    assert not any("default" in t for t in plan.transforms)


def test_rules_after_defaults_conflict_loudly():
    model = presets.build("tiny-llama")
    later = ml.shard({"lm_head.weight": P("mlp")}, Rules(mlp="tp"))
    with pytest.raises(RulesError, match="Rules.default()"):
        ml.plan(model, ml.shard(ml.policies.auto) | later, TINY_MESH)
