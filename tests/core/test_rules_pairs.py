"""Rules as flax's and MaxText's tables: ``(logical, mesh)`` pairs in priority order, a
tuple meaning joint sharding, a repeated name meaning fallbacks; and the keyword form's
refusal of a bare tuple of several axes. The side by side with flax's own resolver is in
``tests/core/test_jax_conformance.py``."""

from __future__ import annotations

import json

import pytest

from meshlab import P, Rules, RulesError, first, joint

MAXTEXT_AXES = ("data", "fsdp", "tensor")


def test_maxtext_joint_rule_shards_one_dimension_over_both_axes():
    # MaxText's ('activation_batch', ('data', 'fsdp')) means P(('data', 'fsdp')), joint
    # sharding as a tuple means inside P; it once resolved to P('data') as fallbacks
    rules = Rules.from_pairs([("activation_batch", ("data", "fsdp"))])
    assert rules.resolve(P("activation_batch", None), MAXTEXT_AXES) == P(("data", "fsdp"))
    assert Rules(activation_batch=joint("data", "fsdp")) == rules
    assert Rules(activation_batch=(("data", "fsdp"),)) == rules
    # the keyword form (and a list of pairs read as keywords) never guesses either way
    for make in (lambda: Rules(activation_batch=("data", "fsdp")),
                 lambda: Rules([("activation_batch", ("data", "fsdp"))])):
        with pytest.raises(RulesError) as ei:
            make()
        msg = str(ei.value)
        assert "activation_batch=joint('data', 'fsdp')" in msg
        assert "activation_batch=first('data', 'fsdp')" in msg
        assert "('data', 'fsdp', None)" in msg and "Rules.from_pairs" in msg


def test_rule_order_decides_not_dimension_order():
    rules = Rules.from_pairs([("embed", "tp"), ("mlp", "tp")])
    assert rules.resolve(P("mlp", "embed"), ("dp", "tp")) == P(None, "tp")
    assert Rules.from_pairs([("mlp", "tp"), ("embed", "tp")]).resolve(
        P("mlp", "embed"), ("dp", "tp")) == P("tp", None)
    # the keyword form is a table in keyword order
    assert Rules(embed="tp", mlp="tp").resolve(P("mlp", "embed"), ("dp", "tp")) == P(None, "tp")


def test_repeated_names_are_fallbacks_tried_in_table_order():
    # flax's docstring example, with 'length' named so meshlab does not take it for a typo
    rules = Rules.from_pairs([("batch", "X"), ("features", "X"), ("heads", "Y"),
                              ("batch", "Z"), ("length", None)])
    assert rules.resolve(P("batch", "length", "heads", "features"), ("X", "Y", "Z")) == \
        P("X", None, "Y", None)
    assert rules.resolve(P("features", "batch"), ("X", "Y", "Z")) == P(None, "X")
    assert rules.resolve(P("heads", "features", "batch"), ("X", "Y", "Z")) == P("Y", None, "X")
    # fallbacks interleave with other names' rules: batch's second rule comes after heads'
    r = Rules.from_pairs([("batch", "X"), ("heads", "X"), ("heads", "Y"), ("batch", "Y")])
    assert r.resolve(P("batch", "heads"), ("X", "Y")) == P("X", "Y")
    assert r.resolve(P("heads"), ("X", "Y")) == P("X")


def test_a_none_rule_claims_the_dimension_unsharded():
    rules = Rules.from_pairs([("embed", None), ("embed", "tp"), ("mlp", [])])
    assert rules.resolve(P("embed", "mlp"), ("dp", "tp")) == P()
    assert rules.get("embed") == ((), ("tp",))
    assert rules.get("mlp") == ()


def test_absent_axes_are_skipped_and_an_all_absent_name_raises():
    rules = Rules.from_pairs([("embed", ("fsdp", "tp")), ("embed", "tp"), ("mlp", "model")])
    assert rules.resolve(P("embed"), ("dp", "tp")) == P("tp")
    with pytest.raises(RulesError, match="did you mean 'tp'"):
        rules.resolve(P("mlp"), ("dp", "tp"))
    assert (rules | Rules(heads="tp")).resolve(P("embed", "heads"), ("tp",)) == P("tp", None)


def test_pairs_repr_json_and_equality():
    grouped = Rules.from_pairs([("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("embed", None)])
    assert grouped == Rules(batch=joint("dp", "fsdp"), embed=("fsdp", None))
    assert repr(grouped) == "Rules(batch=(('dp', 'fsdp'),), embed=('fsdp', None))"
    mixed = Rules.from_pairs([("batch", "X"), ("heads", "X"), ("batch", ("Y", "Z")),
                              ("heads", None)])
    assert repr(mixed) == ("Rules.from_pairs([('batch', 'X'), ('heads', 'X'), "
                           "('batch', ('Y', 'Z')), ('heads', None)])")
    for rules in (grouped, mixed):
        assert eval(repr(rules), {"Rules": Rules}) == rules
        again = Rules.from_json(json.loads(json.dumps(rules.to_json())))
        assert again == rules and again.pairs == rules.pairs
    assert mixed != Rules.from_pairs(reversed(mixed.pairs))      # order is meaning
    assert mixed.pairs[2] == ("batch", ("Y", "Z"))


def test_older_json_reads_as_before():
    old = [["batch", [["dp", "fsdp"], ["dp"], []]], ["mlp", [["tp"]]], ["embed", []]]
    assert Rules.from_json(old) == Rules(batch=first(("dp", "fsdp"), "dp", None), mlp="tp",
                                         embed=None)


def test_union_keeps_the_left_rules_first():
    r = Rules.from_pairs([("embed", "tp")]) | Rules(mlp="tp")
    assert r.resolve(P("mlp", "embed"), ("tp",)) == P(None, "tp")
    with pytest.raises(RulesError, match="'mlp'"):
        Rules.from_pairs([("mlp", "tp"), ("mlp", "dp")]) | Rules(mlp="tp")


@pytest.mark.parametrize("bad, words", [
    ([("embed", first("fsdp", "tp"))], ("repeat the logical axis",)),
    ([("embed", ("fsdp", None))], ("None, an axis name or a tuple",)),
    ([("embed",)], ("(logical axis, mesh axes) pair",)),
    ([("not-a-name", "tp")], ("identifiers",)),
    ({"embed": "tp"}, ("sequence of (logical, mesh axes) pairs",)),
])
def test_bad_pairs_raise_naming_the_fix(bad, words):
    with pytest.raises(RulesError) as ei:
        Rules.from_pairs(bad)
    assert all(w in str(ei.value) for w in words)


@pytest.mark.parametrize("value", [("fsdp", "tp"), ["fsdp", "tp"], (("dp", "tp"), "tp")])
def test_keyword_tuple_of_several_axes_is_refused(value):
    with pytest.raises(RulesError, match="ambiguous") as ei:
        Rules(embed=value)
    assert "embed=first(" in str(ei.value)


def test_keyword_spellings_that_stay():
    assert Rules(embed=("tp",)) == Rules(embed="tp") == Rules(embed=first("tp"))
    assert Rules(embed=("fsdp", "tp", None)) == Rules(embed=first("fsdp", "tp", None))
    assert Rules(embed=first(joint("dp", "tp"), "tp")) == Rules(embed=first(("dp", "tp"), "tp"))
    assert Rules(embed=first("fsdp", "tp")).pairs == (("embed", ("fsdp",)), ("embed", ("tp",)))
    with pytest.raises(RulesError, match="joint"):
        joint()
    with pytest.raises(RulesError, match="first"):
        first()
    with pytest.raises(RulesError, match="put it last"):
        Rules(embed=first(None, "tp"))
