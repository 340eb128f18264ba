"""Every public argument is checked where it enters: for arbitrary values (ints negative and
zero, bools, floats, NaN, strings, None, lists, dicts) each transform constructor, ``P``,
``Mesh``, ``Rules``, ``plan`` and a plan's estimates either succeed or raise a
``meshlab.MeshlabError`` subclass, never an untyped exception. A value that is accepted
must also plan (or be refused with a typed error) on a tiny model on a fake mesh.

Derandomized (the same examples on every run) and small: the whole module runs in seconds.
"""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshlab as ml
from meshlab import P
from meshlab.core.mesh import MAX_RANKS
from meshlab.transforms import Transform

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# -- arbitrary values ---------------------------------------------------------------------
NAMES = ["dp", "tp", "pp", "sp", "fsdp", "batch", "heads", "kv_heads", "mlp", "vocab",
         "embed", "seq", "model", "x y", "", "1f1b", "fp16", "bf16", "fp32", "dynamic",
         "full", "selective", "none", "ring", "all_to_all", "split_gather", "gpipe",
         "interleaved", "zbv", "loss", "rms_norm", "attention", "rotary", "*", "**.bias",
         "[z-a]", "model.layers.*.self_attn.k_proj.weight"]
ATOMS = st.one_of(
    st.integers(min_value=-3, max_value=9),
    st.integers(min_value=-2 ** 40, max_value=2 ** 40),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 2.5, -1.0, math.nan, math.inf]),
    st.sampled_from(NAMES),
    st.text(max_size=4),
    st.none(),
)
VALUES = st.one_of(
    ATOMS,
    st.lists(ATOMS, max_size=3),
    st.tuples(ATOMS, ATOMS),
    st.dictionaries(st.one_of(st.sampled_from(NAMES), st.integers(-1, 3)), ATOMS, max_size=2),
)
SPECS = st.builds(lambda dims, partial: (dims, partial),
                  st.lists(st.one_of(st.none(), st.sampled_from(NAMES[:13]),
                                     st.tuples(st.sampled_from(NAMES[:6]),
                                               st.sampled_from(NAMES[:6]))), max_size=3),
                  st.one_of(st.none(), st.sampled_from(NAMES[:6])))


def _maybe(good):
    """Mostly a valid value (so later checks are reached), sometimes anything at all."""
    return st.one_of(good, good, VALUES)


@functools.lru_cache(maxsize=1)
def _model():
    from meshlab.policies import presets

    return presets.build("tiny-llama")


def _typed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None where it raised a typed error; anything else fails."""
    try:
        return fn(*args, **kwargs)
    except ml.MeshlabError:
        return None


def _p(dims, partial):
    return _typed(P, *dims, partial=partial)


# -- transform constructors ---------------------------------------------------------------
AXES = st.sampled_from(["dp", "tp", "pp", "sp", ("dp",), ("dp", "tp")])
CONSTRUCTORS = {
    "zero_shard": (ml.zero_shard, {"stage": st.sampled_from([0, 1, 2, 3]), "axis": AXES}),
    "data_parallel": (ml.data_parallel, {"axis": AXES}),
    "precision": (ml.precision, {
        "compute": st.sampled_from(["bf16", "fp16", "fp32", "bfloat16"]),
        "reduce": st.sampled_from(["fp32", "bf16"]),
        "loss_scale": st.sampled_from([None, "dynamic", 1024.0, 8]),
        "init_scale": st.sampled_from([2.0 ** 16, 1]),
        "growth_interval": st.sampled_from([1, 2000])}),
    "remat": (ml.remat, {"policy": st.sampled_from(["none", "full", "selective"])}),
    "pipeline": (ml.pipeline, {
        "axis": st.sampled_from(["pp"]),
        "schedule": st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble", "zbv"]),
        "microbatches": st.integers(1, 8),
        "virtual_stages": st.sampled_from([None, 1, 2]),
        "layers_per_stage": st.sampled_from([None, (1, 1), [1, 1, 0]])}),
    "sequence": (ml.sequence, {"axis": st.sampled_from(["sp", "tp"]),
                               "mode": st.sampled_from(["split_gather", "all_to_all",
                                                        "ring"])}),
    "shard": (ml.shard, {
        "specs": st.sampled_from([ml.policies.auto,
                                  {"model.layers.*.mlp.up_proj.weight": P("mlp", None)},
                                  {"lm_head.weight": P("tp")}]),
        "rules": st.sampled_from([None, ml.Rules(mlp="tp"), {"heads": "tp"}]),
        "activations": st.sampled_from([None, {"model.layers.*": P("batch", None, None)}])}),
}
REQUIRED = {"specs"}
MESHES = [dict(dp=2, tp=2), dict(tp=4), dict(pp=2), dict(sp=2), dict(dp=2, pp=2), dict(dp=1)]


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
@FUZZ
@given(data=st.data())
def test_transform_constructors_raise_only_typed_errors(name, data):
    fn, params = CONSTRUCTORS[name]
    kwargs = {k: data.draw(_maybe(good), label=k) for k, good in params.items()
              if k in REQUIRED or data.draw(st.booleans(), label=f"pass {k}")}
    t = _typed(fn, **kwargs)
    if t is None:
        return
    assert isinstance(t, Transform)
    assert repr(t)
    again = _typed(lambda: type(t).from_json(t.to_json()))
    assert again is None or repr(again) == repr(t)
    mesh = ml.Mesh(**data.draw(st.sampled_from(MESHES), label="mesh"), fake=True)
    p = _typed(ml.plan, _model(), t, mesh)
    if p is not None:
        _typed(p.memory)
        _typed(p.comm, batch=data.draw(_maybe(st.integers(1, 8)), label="batch"),
               seq=data.draw(_maybe(st.integers(1, 64)), label="seq"))


@FUZZ
@given(ops=st.lists(_maybe(st.sampled_from(["rms_norm", "rotary", "attention", "loss"])),
                    max_size=4))
def test_fuse_raises_only_typed_errors(ops):
    t = _typed(ml.fuse, *ops)
    if t is not None:
        _typed(ml.plan, _model(), t, ml.Mesh(dp=2, fake=True))


# -- values: P, Mesh, Rules ---------------------------------------------------------------
@FUZZ
@given(entries=st.lists(VALUES, max_size=4), partial=VALUES, dim=VALUES)
def test_p_raises_only_typed_errors(entries, partial, dim):
    p = _typed(P, *entries, partial=partial)
    if p is not None:
        assert P.from_json(p.to_json()) == p
        _typed(p.dim_axes, dim)
        _typed(p.padded, dim)
    _typed(P.from_json, partial)


@FUZZ
@given(sizes=st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=3)),
                             VALUES, max_size=3),
       positional=st.one_of(st.none(), VALUES),
       fake=st.one_of(st.just(True), VALUES.filter(lambda v: v is not False)),
       device_type=st.one_of(st.none(), VALUES), name=VALUES, rank=VALUES)
def test_mesh_raises_only_typed_errors(sizes, positional, fake, device_type, name, rank):
    # fake=False would start a process group in this process: always fake, or not a bool
    mesh = _typed(ml.Mesh, positional, fake=fake, device_type=device_type, **{
        k: v for k, v in sizes.items() if k not in ("fake", "device_type", "_device_mesh",
                                                   "_ranks")})
    if mesh is not None:
        assert mesh.fake and mesh.size <= MAX_RANKS
        _typed(mesh.__getitem__, name)
        _typed(mesh.coordinate, rank)
        _typed(mesh.flatten, *mesh.axis_names[:2], name=name)
        _typed(ml.Mesh.parse, name)


@FUZZ
@given(pairs=st.one_of(VALUES, st.lists(st.tuples(VALUES, VALUES), max_size=3)),
       kwargs=st.dictionaries(st.sampled_from(NAMES[:13]), VALUES, max_size=3),
       other=VALUES, spec=SPECS)
def test_rules_raise_only_typed_errors(pairs, kwargs, other, spec):
    rules = _typed(ml.Rules, pairs, **kwargs)
    if rules is None:
        return
    assert ml.Rules.from_json(rules.to_json()) == rules
    _typed(lambda: rules | other)
    _typed(lambda: other | rules)
    _typed(ml.Rules.from_json, other)
    p = _p(*spec)
    if p is not None:
        _typed(rules.resolve, p, ("dp", "tp"))


# -- plan, its estimates and its JSON -----------------------------------------------------
GLOBS = ["model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
         "model.layers.*.mlp.down_proj.weight", "model.layers.*.mlp.up_proj.weight",
         "lm_head.weight", "model.embed_tokens.weight", "**.bias", "model.norm.weight"]


@FUZZ
@given(specs=st.dictionaries(st.one_of(st.sampled_from(GLOBS), ATOMS), SPECS, max_size=3),
       rules=st.one_of(st.none(), st.dictionaries(st.sampled_from(NAMES[:13]),
                                                  st.sampled_from(NAMES[:6] + [None]),
                                                  max_size=3)),
       mesh=st.dictionaries(st.sampled_from(["dp", "tp", "pp", "fsdp"]),
                            st.integers(1, 4), min_size=1, max_size=3),
       uneven=_maybe(st.booleans()), batch=VALUES, seq=VALUES, coord=VALUES,
       optimizer=_maybe(st.sampled_from(["adamw", "sgd"])))
def test_plan_raises_only_typed_errors(specs, rules, mesh, uneven, batch, seq, coord,
                                       optimizer):
    tree = {k: (_p(*v) or P()) for k, v in specs.items()}
    t = _typed(ml.shard, tree, rules)
    if t is None:
        return
    p = _typed(ml.plan, _model(), t, ml.Mesh(**mesh, fake=True), uneven=uneven)
    if p is None:
        return
    _typed(p.memory, optimizer=optimizer)
    _typed(p.comm, batch=batch, seq=seq)
    _typed(p.comm, coord=coord)
    again = ml.Plan.from_json(p.to_json())
    assert again.fqns == p.fqns


@FUZZ
@given(model=VALUES, spec=VALUES, mesh=VALUES, text=st.one_of(VALUES, st.text(max_size=20)))
def test_plan_arguments_of_the_wrong_kind_raise_typed_errors(model, spec, mesh, text):
    _typed(ml.plan, model, spec, mesh)
    _typed(ml.plan, _model(), spec, ml.Mesh(dp=2, fake=True))
    _typed(ml.plan, _model(), None, mesh)
    _typed(ml.Plan.from_json, text)
    _typed(ml.Plan.from_json, '{"format": "meshlab.plan/1", "params": ' + repr(text) + "}")


# -- training helpers: the data loader, microbatches, shard_map's specs -------------------
@FUZZ
@given(batch_size=_maybe(st.integers(1, 16)), axes=_maybe(st.sampled_from([None, ("dp",), ()])),
       shuffle=_maybe(st.booleans()), seed=_maybe(st.integers(0, 9)),
       drop_last=_maybe(st.booleans()), k=_maybe(st.integers(1, 4)),
       specs=st.one_of(VALUES, st.lists(st.one_of(st.none(), st.just(P("dp"))), max_size=2)))
def test_training_helpers_raise_only_typed_errors(batch_size, axes, shuffle, seed, drop_last,
                                                  k, specs):
    import torch

    from meshlab.train.step import _split

    mesh = ml.Mesh(dp=2, tp=2, fake=True)
    _typed(ml.dataloader, list(range(16)), mesh, batch_size, axes=axes, shuffle=shuffle,
           seed=seed, drop_last=drop_last)
    _typed(_split, {"input_ids": torch.zeros(4, 2)}, k)
    _typed(ml.shard_map, lambda x: x, specs, specs)
