"""Rules: logical axis names -> mesh axes with ordered fallbacks."""

from __future__ import annotations

import json

import pytest

import meshlab as ml
from meshlab import LOGICAL_AXES, P, Rules, RulesError, SpecError
from meshlab._context import current_rules

AXES = ("dp", "tp")


# ---------------------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------------------

def test_single_rule_maps_to_axis():
    r = Rules(batch="dp", mlp="tp")
    assert r.resolve(P("batch", "mlp"), AXES) == P("dp", "tp")
    assert r.resolve(P("mlp", None, "batch"), AXES) == P("tp", None, "dp")


def test_first_present_fallback_wins():
    r = Rules(embed=("fsdp", "tp", "dp"))
    # 'fsdp' is not in the mesh: the next one present wins
    assert r.resolve(P("embed"), AXES) == P("tp")
    assert r.resolve(P("embed"), ("fsdp", "tp")) == P("fsdp")
    assert r.resolve(P("embed"), ("dp",)) == P("dp")
    # none present: replicated
    assert r.resolve(P("embed"), ("pp",)) == P(None)


def test_first_unused_fallback_wins():
    r = Rules(batch=("dp",), embed=("dp", "tp"), mlp="tp")
    # dim 0 takes 'dp', so embed falls back to 'tp'
    assert r.resolve(P("batch", "embed"), AXES) == P("dp", "tp")
    # embed first takes 'dp' itself
    assert r.resolve(P("embed", "mlp"), AXES) == P("dp", "tp")
    # mlp takes 'tp'; embed wanted dp or tp: dp
    assert r.resolve(P("mlp", "embed"), AXES) == P("tp", "dp")
    # both taken: replicate
    assert r.resolve(P("batch", "mlp", "embed"), AXES) == P("dp", "tp", None)


def test_doc_example():
    rules = Rules(batch=("dp",), embed=("fsdp", "tp"), mlp="tp")
    assert rules.resolve(P("batch", "embed"), AXES) == P("dp", "tp")
    assert rules.resolve(P("mlp", "embed"), AXES) == P("tp", None)


def test_tuple_alternative_shards_over_two_axes():
    r = Rules(embed=(("dp", "tp"), "tp"), batch="dp")
    assert r.resolve(P("embed"), AXES) == P(("dp", "tp"))
    assert r.resolve(P(None, "embed"), AXES) == P(None, ("dp", "tp"))
    # 'dp' taken by batch: the pair cannot be used, the single fallback can
    assert r.resolve(P("batch", "embed"), AXES) == P("dp", "tp")
    # a pair needs both axes present
    assert r.resolve(P("embed"), ("tp",)) == P("tp")
    assert r.resolve(P("embed"), ("dp",)) == P(None)


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
    from meshlab._rules import resolve

    assert resolve(P("dp", "tp"), AXES, None) == P("dp", "tp")
    with pytest.raises(SpecError, match="'sp'"):
        resolve(P("sp"), AXES, None)


def test_mesh_axes_pass_through():
    r = Rules(batch="dp")
    assert r.resolve(P("tp", "batch"), AXES) == P("tp", "dp")
    assert r.resolve(P("dp", "tp"), AXES) == P("dp", "tp")


def test_mesh_axes_are_claimed_first():
    # 'embed' would take 'dp', but dim 1 names 'dp' directly: embed must fall back
    r = Rules(embed=("dp", "tp"))
    assert r.resolve(P("embed", "dp"), AXES) == P("tp", "dp")
    # and if nothing is left, embed replicates rather than steal the named axis
    assert Rules(embed="dp").resolve(P("embed", "dp"), AXES) == P(None, "dp")
    # a named axis in partial is claimed too
    assert Rules(embed=("tp", "dp")).resolve(P("embed", partial="tp"), AXES) == \
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
    (Rules(mlp=("fsdp", "tp")), Rules(mlp="tp"), "('fsdp', 'tp')", "'tp'"),
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
    (Rules(batch=("dp",), embed=("fsdp", "tp")), "Rules(batch='dp', embed=('fsdp', 'tp'))"),
    (Rules(embed=None), "Rules(embed=None)"),
    (Rules(embed=(("dp", "tp"), "tp")), "Rules(embed=(('dp', 'tp'), 'tp'))"),
    (Rules(embed=(("dp", "tp"),)), "Rules(embed=(('dp', 'tp'),))"),
])
def test_repr_pastes_back(rules, text):
    assert repr(rules) == text
    again = eval(repr(rules), {"Rules": Rules})
    assert again == rules
    assert hash(again) == hash(rules)


@pytest.mark.parametrize("rules", [
    Rules(),
    Rules(batch="dp", embed=("fsdp", "tp"), mlp=None),
    Rules(embed=(("dp", "tp"), "tp"), vocab="tp", custom=("sp",)),
])
def test_json_round_trip(rules):
    again = Rules.from_json(json.loads(json.dumps(rules.to_json())))
    assert again == rules
    assert list(again.items()) == list(rules.items())
    assert repr(again) == repr(rules)


def test_mapping_protocol():
    r = Rules(batch="dp", embed=("fsdp", "tp"))
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
