"""``Rules`` side by side with flax's resolver (``flax.linen.logical_to_mesh_axes``, the
one MaxText uses): flax's documented examples, its guide's model with logically
partitioned parameters and ``with_logical_constraint``, two MaxText rule tables, and a
few hundred random tables. On a mesh that has every axis a table names, meshlab resolves
every spec exactly as flax does. On a smaller mesh meshlab skips the rules naming absent
axes (flax would name them, and JAX refuse the spec): it resolves as flax does the table
without those rules, and raises where a logical axis the spec uses has no rule left.

No processes: the examples run in this process (flax's on JAX's 4 host devices).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from meshlab import LOGICAL_AXES, P, Rules, RulesError, SpecError
from tests.core._jax import jax_mesh, jx, key  # noqa: F401


def flax_resolve(names, pairs):
    import flax.linen as nn

    return nn.logical_to_mesh_axes(tuple(names), [list(p) for p in pairs])


def present_only(pairs, mesh_axes):
    """The table without the rules naming an axis ``mesh_axes`` lacks."""
    axes = lambda v: () if v is None else (v,) if isinstance(v, str) else tuple(v)  # noqa: E731
    return [(n, v) for n, v in pairs if set(axes(v)) <= set(mesh_axes)]


def assert_resolves_as_flax(pairs, names, mesh_axes) -> None:
    """meshlab on ``mesh_axes`` against flax on the table less the rules naming absent
    axes; where a used logical axis has no rule left, meshlab raises instead."""
    rules = Rules.from_pairs(pairs)
    kept = present_only(pairs, mesh_axes)
    stranded = [n for n in names if n in rules and n not in dict(kept)]
    if stranded:
        with pytest.raises(RulesError, match=repr(stranded[0])):
            rules.resolve(P(*names), mesh_axes)
        return
    got = rules.resolve(P(*names), mesh_axes)
    assert key(got) == key(flax_resolve(names, kept)), (pairs, names, mesh_axes)


# -- flax's examples ---------------------------------------------------------------------
def test_flax_docstring_example():
    # logical_to_mesh_axes's docstring: rules in order of precedence, 'batch' twice
    pairs = [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")]
    names = ("batch", "length", "heads", "features")
    assert key(flax_resolve(names, pairs)) == key(P("X", None, "Y", None))
    # 'length' has no rule: flax replicates it, meshlab takes it for a typo unless named
    with pytest.raises(SpecError, match="'length'"):
        Rules.from_pairs(pairs).resolve(P(*names), ("X", "Y", "Z"))
    assert_resolves_as_flax(pairs + [("length", None)], names, ("X", "Y", "Z"))


@pytest.mark.parametrize("pairs", [
    [("foo", "data"), ("bar", "model"), ("baz", None)],
    [("foo", "model"), ("bar", None), ("baz", "data")],
    [("foo", "model"), ("bar", "model"), ("baz", "data")],          # priority by rule order
    [("baz", "data"), ("foo", "model"), ("bar", "model"), ("bar", "data")],
    [("foo", ("data", "model")), ("bar", "model"), ("baz", "data"), ("baz", None)],
    [("foo", None), ("foo", "model"), ("bar", ("model", "data")), ("baz", "data")],
])
@pytest.mark.parametrize("names", [("foo", "bar", "baz"), ("bar", "foo", "baz"),
                                   ("baz", None, "foo"), ("bar",), (None, "bar", "foo")])
def test_small_tables_resolve_as_flax(pairs, names):
    assert_resolves_as_flax(pairs, [n for n in names], ("data", "model"))


def test_random_tables_resolve_as_flax():
    rnd = random.Random(0)
    logical, mesh = ["a", "b", "c", "d"], ["w", "x", "y", "z"]
    for _ in range(400):
        pairs = []
        for _ in range(rnd.randint(1, 8)):
            k = rnd.choice((0, 1, 1, 1, 2, 2, 3))
            v = None if k == 0 else rnd.choice(mesh) if k == 1 else tuple(rnd.sample(mesh, k))
            pairs.append((rnd.choice(logical), v))
        used = sorted({n for n, _ in pairs})
        names = rnd.sample(used, rnd.randint(1, len(used))) + [None] * rnd.randint(0, 1)
        rnd.shuffle(names)
        assert_resolves_as_flax(pairs, names, mesh)                       # every axis
        assert_resolves_as_flax(pairs, names, rnd.sample(mesh, rnd.randint(1, 3)))


def test_flax_guide_model(jx):
    """flax's "Scale up Flax Modules on multiple devices" guide: parameters partitioned
    with logical names, activations constrained with with_logical_constraint, and one
    rule table for both; meshlab resolves the same names to the same specs."""
    import flax.linen as nn
    import jax.numpy as jnp

    class DotReluDot(nn.Module):
        depth: int

        @nn.compact
        def __call__(self, x):
            init = nn.initializers.xavier_normal()
            w1 = self.param("W1", nn.with_logical_partitioning(init, ("embed", "hidden")),
                            (x.shape[-1], self.depth))
            y = nn.with_logical_constraint(jx.nn.relu(x @ w1), ("batch", "hidden"))
            w2 = self.param("W2", nn.with_logical_partitioning(init, ("hidden", "embed")),
                            (self.depth, x.shape[-1]))
            return nn.with_logical_constraint(y @ w2, ("batch", "embed")), y

    pairs = (("batch", "data"), ("hidden", "model"))
    rules = Rules.from_pairs(pairs)
    mesh = jax_mesh(jx, (2, 2), ("data", "model"))
    model, x = DotReluDot(8), jnp.ones((8, 4))
    # the guide's steps: logical specs of the abstract variables, their shardings by the
    # rules, a jitted init laid out so, and the constrained activations of a forward
    logical = nn.get_partition_spec(jx.eval_shape(model.init, jx.random.key(0), x))
    shardings = nn.logical_to_mesh_sharding(logical, mesh, pairs)
    with jx.set_mesh(mesh), nn.logical_axis_rules(pairs):
        variables = jx.jit(model.init, out_shardings=shardings)(jx.random.key(0), x)
        z, y = jx.jit(model.apply)(variables, x)
    params = variables["params"]
    seen = {"W1": params["W1"].value, "W2": params["W2"].value, "z": z, "y": y}
    names = {"W1": tuple(logical["params"]["W1"]), "W2": tuple(logical["params"]["W2"]),
             "z": ("batch", "embed"), "y": ("batch", "hidden")}
    assert names["W1"] == ("embed", "hidden")
    for k, value in seen.items():
        assert key(rules.resolve(P(*names[k]), ("data", "model"))) == \
            key(value.sharding.spec), k
    assert key(value.sharding.spec) == (("data",), ("model",))


# -- MaxText ---------------------------------------------------------------------------
# Two excerpts of MaxText's `logical_axis_rules` (MaxText/configs/base.yml), typed from
# memory of the public config, not copied: a recent one and an older one. Written as the
# YAML writes them, lists for tuples.
MAXTEXT_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context", "tensor",
                "tensor_transpose", "tensor_sequence", "expert", "autoregressive")
MAXTEXT_TABLES = {
    "recent": [
        ["activation_batch", ["data", "fsdp", "fsdp_transpose", "expert"]],
        ["activation_heads", ["tensor", "tensor_transpose", "sequence", "tensor_sequence"]],
        ["activation_kv_heads", ["tensor", "tensor_transpose", "sequence", "tensor_sequence"]],
        ["activation_length", ["sequence", "context"]],
        ["activation_length", ["context"]],
        ["activation_embed", ["tensor", "tensor_transpose"]],
        ["activation_mlp", ["tensor", "tensor_transpose", "tensor_sequence"]],
        ["activation_kv", ["tensor", "tensor_transpose", "tensor_sequence"]],
        ["activation_vocab", ["tensor", "tensor_transpose", "sequence", "tensor_sequence"]],
        ["activation_vocab", ["tensor", "tensor_transpose"]],
        ["activation_vocab", "tensor_sequence"],
        ["activation_vocab", ["sequence", "context"]],
        ["activation_stage", "stage"],
        ["mlp", ["fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"]],
        ["vocab", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
        ["heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
        ["kv_heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
        ["embed", ["fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context",
                   "expert"]],
        ["embed", ["fsdp", "sequence", "tensor_transpose", "context", "expert"]],
        ["embed", ["fsdp", "fsdp_transpose", "sequence", "context", "expert"]],
        ["embed", ["fsdp", "sequence", "context", "expert"]],
        ["norm", ["tensor", "tensor_transpose", "tensor_sequence"]],
        ["layers", "stage"],
        ["kv", []],
        ["kv_head_dim", []],
        ["exp", "expert"],
    ],
    "older": [
        ["activation_batch", ["data", "fsdp", "fsdp_transpose"]],
        ["activation_heads", ["tensor", "sequence"]],
        ["activation_length", "sequence"],
        ["activation_embed", "tensor"],
        ["activation_mlp", "tensor"],
        ["activation_kv", "tensor"],
        ["activation_vocab", ["tensor", "sequence"]],
        ["activation_vocab", "tensor"],
        ["activation_vocab", "sequence"],
        ["mlp", ["fsdp_transpose", "tensor", "autoregressive"]],
        ["vocab", ["tensor", "autoregressive"]],
        ["embed", ["fsdp", "fsdp_transpose", "sequence"]],
        ["embed", ["fsdp", "sequence"]],
        ["heads", ["tensor", "autoregressive"]],
        ["kv", []],
        ["cache_heads", ["autoregressive", "tensor"]],
        ["cache_kv", []],
    ],
}
MAXTEXT_SPECS = [
    ("activation_batch", "activation_length", "activation_embed"),
    ("activation_batch", "activation_length", "activation_heads", "activation_kv"),
    ("activation_batch", "activation_length", "activation_mlp"),
    ("activation_batch", "activation_length", "activation_vocab"),
    ("activation_batch", None, "activation_embed"),
    ("embed", "mlp"), ("mlp", "embed"), ("embed", "heads", "kv"), ("heads", "kv", "embed"),
    ("vocab", "embed"), ("embed", "vocab"), ("layers", "embed", "mlp"), ("exp", "embed", "mlp"),
    ("embed", "kv_heads", "kv_head_dim"), ("norm",), ("cache_heads", "cache_kv"),
]


@pytest.mark.parametrize("table", list(MAXTEXT_TABLES))
def test_maxtext_tables_resolve_as_flax(table):
    pairs = MAXTEXT_TABLES[table]
    rules = Rules.from_pairs(pairs)
    small = ("data", "fsdp", "tensor")
    for names in MAXTEXT_SPECS:
        unknown = [n for n in names if n and n not in rules and n not in LOGICAL_AXES]
        if unknown:
            # a name the table lacks: flax replicates it, meshlab refuses it as a typo
            assert key(flax_resolve(names, pairs)) == key(flax_resolve(
                names, pairs + [[n, None] for n in unknown]))
            with pytest.raises(SpecError, match=repr(unknown[0])):
                rules.resolve(P(*names), MAXTEXT_AXES)
            continue
        assert_resolves_as_flax(pairs, names, MAXTEXT_AXES)
        assert_resolves_as_flax(pairs, names, small)
    # the joint rule that a reading as fallbacks would have turned into P('data')
    assert rules.resolve(P("activation_batch"), MAXTEXT_AXES) == P(tuple(pairs[0][1]))


def test_maxtext_excerpts_are_tables_flax_accepts():
    for pairs in MAXTEXT_TABLES.values():
        rules = Rules.from_pairs(pairs)
        assert len(rules.pairs) == len(pairs)
        assert np.all([isinstance(n, str) for n, _ in rules.pairs])
