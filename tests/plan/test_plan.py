"""trace, shard, plan, bind, diff, JSON, rendering and memory of plans (meta models only)."""

from __future__ import annotations

import math
import time
import types

import pytest
import torch
import transformers
from torch import nn

import meshlab as ml
from meshlab import P, PlanError, PolicyError, Rules, SpecError
from meshlab.policies import _registry

TP_DP_RULES = Rules(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed="dp")
MESH = ml.Mesh(dp=2, tp=2, fake=True)


def _hf(config_cls, dtype=None, **kw):
    cfg = config_cls(**kw)
    with torch.device("meta"):
        if dtype is None:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def llama():
    return _hf(transformers.LlamaConfig, tie_word_embeddings=False, **TINY)


@pytest.fixture(scope="module")
def llama_tied():
    return _hf(transformers.LlamaConfig, tie_word_embeddings=True, **TINY)


@pytest.fixture(scope="module")
def qwen2():
    return _hf(transformers.Qwen2Config, tie_word_embeddings=True, **TINY)


class Tiny(nn.Module):
    """A hand-countable model: Linear(8 -> 6), an odd-sized vector, a frozen matrix."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 6)                                         # (6, 8) + (6,)
        self.n = nn.Parameter(torch.ones(5))                             # 5: uneven over 2
        self.f = nn.Parameter(torch.ones(4, 4), requires_grad=False)     # frozen


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def _meta(cls, dtype=None):
    with torch.device("meta"):
        m = cls()
    return m.to(dtype) if dtype is not None else m


# ---------------------------------------------------------------------------------------
# trace
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["llama", "llama_tied", "qwen2"])
def test_trace_records_every_param(which, request):
    model = request.getfixturevalue(which)
    plan = ml.trace(model)
    params = list(model.named_parameters(remove_duplicate=False))
    assert plan.fqns == tuple(n for n, _ in params)
    for e, (n, p) in zip(plan, params):
        assert e.shape == tuple(p.shape)
        assert e.dtype == str(p.dtype).replace("torch.", "")
        assert e.spec == P() and e.mesh_spec is None
        assert e.module == n.rpartition(".")[0]
    assert not plan.is_bound
    assert plan.model.cls == type(model).__name__
    assert plan.model.model_type == model.config.model_type
    assert plan.model.base_prefix == "model"
    assert plan.model.blocks == ("model.layers.0", "model.layers.1")
    assert plan.model.config_get("hidden_size") == 64
    # tracing only reads: the model stays on meta
    assert all(p.is_meta for p in model.parameters())


def test_trace_tied_params(llama_tied, llama):
    plan = ml.trace(llama_tied)
    assert plan["lm_head.weight"].tied_to == "model.embed_tokens.weight"
    assert plan["model.embed_tokens.weight"].tied_to is None
    assert [e.fqn for e in plan if e.tied_to] == ["lm_head.weight"]
    assert all(e.tied_to is None for e in ml.trace(llama))


def test_trace_plain_module():
    m = _meta(TiedLM)
    plan = ml.trace(m)
    assert plan.fqns == ("emb.weight", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                         "blocks.1.bias", "blocks.2.weight", "blocks.2.bias", "head.weight")
    assert plan["head.weight"].tied_to == "emb.weight"
    assert plan["head.weight"].module == "head"
    assert plan.model.model_type is None and plan.model.cls == "TiedLM"
    assert plan.model.blocks == ("blocks.0", "blocks.1", "blocks.2")
    t = ml.trace(_meta(Tiny))
    assert t["f"].requires_grad is False and t["n"].requires_grad is True
    assert t["a.weight"].numel == 48
    with pytest.raises(KeyError):
        t["nope"]


# ---------------------------------------------------------------------------------------
# shard with the auto policy
# ---------------------------------------------------------------------------------------

LAYER_SPECS_TP_DP = {
    "self_attn.q_proj.weight": (P("heads", "embed"), P("tp", "dp"), "colwise"),
    "self_attn.k_proj.weight": (P("kv_heads", "embed"), P("tp", "dp"), "colwise"),
    "self_attn.v_proj.weight": (P("kv_heads", "embed"), P("tp", "dp"), "colwise"),
    "self_attn.o_proj.weight": (P("embed", "heads"), P("dp", "tp"), "rowwise"),
    "mlp.gate_proj.weight": (P("mlp", "embed"), P("tp", "dp"), "colwise"),
    "mlp.up_proj.weight": (P("mlp", "embed"), P("tp", "dp"), "colwise"),
    "mlp.down_proj.weight": (P("embed", "mlp"), P("dp", "tp"), "rowwise"),
    "input_layernorm.weight": (P("embed"), P("dp"), "norm"),
    "post_attention_layernorm.weight": (P("embed"), P("dp"), "norm"),
}


def test_auto_policy_llama_specs(llama):
    plan = ml.plan(llama, ml.shard(ml.policies.auto, TP_DP_RULES), MESH)
    assert plan.is_bound and plan.mesh_shape == {"dp": 2, "tp": 2}
    for i in range(2):
        for leaf, (spec, mesh_spec, style) in LAYER_SPECS_TP_DP.items():
            e = plan[f"model.layers.{i}.{leaf}"]
            assert (e.spec, e.mesh_spec) == (spec, mesh_spec), e.fqn
            assert e.tags[0] == style
    e = plan["model.embed_tokens.weight"]
    assert (e.spec, e.mesh_spec, e.tags) == (P("vocab", "embed"), P("tp", "dp"),
                                            ("embedding_rowwise",))
    e = plan["lm_head.weight"]
    assert (e.spec, e.mesh_spec, e.tags) == (P("vocab", "embed"), P("tp", "dp"), ("vocab",))
    e = plan["model.norm.weight"]
    assert (e.spec, e.mesh_spec) == (P("embed"), P("dp"))
    # The final norm runs after the sequence is gathered again: not sequence-parallel.
    assert "sequence_parallel" not in e.tags
    assert "sequence_parallel" in plan["model.layers.0.input_layernorm.weight"].tags
    assert plan.local_shape("model.layers.0.mlp.down_proj.weight") == (32, 64)
    assert plan.local_shape("lm_head.weight") == (128, 32)
    assert plan.rules == TP_DP_RULES
    assert plan.transforms == (repr(ml.shard(ml.policies.auto, TP_DP_RULES)),)
    # the decoder block output is an activation boundary
    acts = {a.module: a.output for a in plan.activations if a.output is not None}
    assert set(acts) == {"model.layers.0", "model.layers.1"}
    assert acts["model.layers.0"] == P("dp")    # embed wanted 'dp', batch had it


def test_auto_policy_pure_tp_rules(llama):
    rules = Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp")
    plan = ml.plan(llama, ml.shard(ml.policies.auto, rules), ml.Mesh(tp=2, fake=True))
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
    assert ms["model.norm.weight"] == P()
    assert plan.unused_axes() == ()


def test_attention_heads_split_whole(llama):
    # 4 query heads, 2 KV heads. On tp=4 the KV heads cannot be split: they are replicated.
    rules = Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp")
    plan = ml.plan(llama, ml.shard(ml.policies.auto, rules), ml.Mesh(tp=4, fake=True))
    assert plan["model.layers.0.self_attn.q_proj.weight"].mesh_spec == P("tp")
    for proj in ("k_proj", "v_proj"):
        e = plan[f"model.layers.1.self_attn.{proj}.weight"]
        assert e.mesh_spec == P() and "kv_replicated" in e.tags
    # On tp=3 the 4 query heads cannot be split whole.
    with pytest.raises(SpecError, match="4 attention heads"):
        ml.plan(llama, ml.shard(ml.policies.auto, rules), ml.Mesh(tp=3, fake=True),
                uneven=True)


def test_auto_policy_qwen2_biases_and_tied_head(qwen2):
    plan = ml.plan(qwen2, ml.shard(ml.policies.auto, TP_DP_RULES), MESH)
    for proj, axis in (("q_proj", "heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads")):
        e = plan[f"model.layers.1.self_attn.{proj}.bias"]
        assert e.spec == P(axis) and e.mesh_spec == P("tp")
    head, emb = plan["lm_head.weight"], plan["model.embed_tokens.weight"]
    assert head.tied_to == emb.fqn
    assert head.mesh_spec == emb.mesh_spec == P("tp", "dp")
    # a tied tensor is counted once
    n = sum(math.prod(plan.local_shape(e.fqn)) for e in plan if e.tied_to is None)
    assert plan.memory().params == 4 * n
    assert n < sum(math.prod(plan.local_shape(e.fqn)) for e in plan)


def test_auto_policy_needs_a_config():
    with pytest.raises(PolicyError, match="model_type"):
        ml.plan(_meta(Tiny), ml.shard(ml.policies.auto), MESH)


def test_unregistered_model_type_without_tp_plan(monkeypatch):
    monkeypatch.setitem(_registry._REGISTRY, "zz_test_family", ml.policies.DECODER)
    monkeypatch.delitem(_registry._REGISTRY, "gpt2")
    gpt2 = _hf(transformers.GPT2Config, n_embd=32, n_layer=1, n_head=2, vocab_size=64,
               n_positions=16)
    with pytest.raises(PolicyError) as ei:
        ml.plan(gpt2, ml.shard(ml.policies.auto), MESH)
    msg = str(ei.value)
    assert "'gpt2'" in msg
    assert "zz_test_family" in msg               # lists what is registered
    m = _meta(Tiny)
    m.config = types.SimpleNamespace(model_type="my_family")
    with pytest.raises(PolicyError, match="my_family"):
        ml.plan(m, ml.shard(ml.policies.auto), MESH)


def test_registered_policy_is_used(monkeypatch):
    pol = ml.policies.Policy(name="mine", params=(("a.weight", P("mlp")),))
    monkeypatch.setitem(_registry._REGISTRY, "my_family", pol)
    m = _meta(Tiny)
    m.config = types.SimpleNamespace(model_type="my_family")
    plan = ml.plan(m, ml.shard(ml.policies.auto, Rules(mlp="tp")), MESH)
    assert plan["a.weight"].mesh_spec == P("tp")
    assert plan["a.bias"].mesh_spec == P()


# ---------------------------------------------------------------------------------------
# shard with globs and pytrees
# ---------------------------------------------------------------------------------------

def test_shard_with_globs(llama):
    specs = {
        "model.layers.*.mlp.up_proj.weight": P("mlp", "embed"),
        "model.layers.*.self_attn.o_proj.weight": P(None, "tp"),
        "**.post_attention_layernorm.weight": P("dp"),
    }
    plan = ml.plan(llama, ml.shard(specs, Rules(mlp="tp", embed="dp")), MESH)
    for i in range(2):
        assert plan[f"model.layers.{i}.mlp.up_proj.weight"].mesh_spec == P("tp", "dp")
        assert plan[f"model.layers.{i}.self_attn.o_proj.weight"].mesh_spec == P(None, "tp")
        assert plan[f"model.layers.{i}.post_attention_layernorm.weight"].mesh_spec == P("dp")
        assert plan[f"model.layers.{i}.mlp.gate_proj.weight"].mesh_spec == P()
    assert plan["lm_head.weight"].mesh_spec == P()
    # '*' is one segment: it does not match across dots
    with pytest.raises(PlanError):
        ml.plan(llama, ml.shard({"model.*.mlp.up_proj.weight": P("tp")}), MESH)


def test_shard_globs_accept_mapping_of_none(llama):
    plan = ml.plan(llama, ml.shard({"lm_head.weight": None}), MESH)
    assert plan["lm_head.weight"].mesh_spec == P()


def test_first_match_wins(llama):
    specific_first = {
        "model.layers.0.mlp.up_proj.weight": P("tp", None),
        "model.layers.*.mlp.*.weight": P(None, "tp"),
    }
    plan = ml.plan(llama, ml.shard(specific_first), MESH)
    assert plan["model.layers.0.mlp.up_proj.weight"].mesh_spec == P("tp")
    assert plan["model.layers.0.mlp.gate_proj.weight"].mesh_spec == P(None, "tp")
    assert plan["model.layers.1.mlp.up_proj.weight"].mesh_spec == P(None, "tp")
    general_first = dict(reversed(list(specific_first.items())))
    plan = ml.plan(llama, ml.shard(general_first), MESH)
    assert plan["model.layers.0.mlp.up_proj.weight"].mesh_spec == P(None, "tp")


def test_glob_matching_nothing_raises(llama):
    with pytest.raises(PlanError, match=r"model\.layers\.\*\.mlp\.upproj\.weight"):
        ml.plan(llama, ml.shard({"model.layers.*.mlp.up_proj.weight": P("tp"),
                                 "model.layers.*.mlp.upproj.weight": P("tp")}), MESH)


@pytest.mark.parametrize("glob, fqn, hit", [
    ("layers.*.w", "layers.0.w", True),
    ("layers.*.w", "layers.0.1.w", False),       # '*' is exactly one segment
    ("layers.*.w", "layers..w", True),
    ("a.**.w", "a.b.w", True),
    ("a.**.w", "a.b.c.d.w", True),
    ("**.bias", "x.y.bias", True),
    ("**.bias", "x.weight", False),
    ("layers.[01].w", "layers.1.w", True),
    ("layers.[01].w", "layers.2.w", False),
    ("a?c", "abc", True),
    ("a?c", "a.c", False),                        # '?' is one character of one segment
    ("a.**.w", "a.w", True),                      # '**' is any number of segments: zero too
    ("**.bias", "bias", True),
])
def test_glob_semantics(glob, fqn, hit):
    from meshlab.core.specs_tree import glob_match

    assert glob_match(glob, fqn) is hit


def test_globs_do_not_depend_on_fnmatch(monkeypatch):
    # fnmatch.translate() changed its output across Python versions ('\\Z' became '\\z' in
    # 3.14); meshlab builds its glob regexes itself, so a broken fnmatch changes nothing.
    import fnmatch

    from meshlab.core.specs_tree import _glob_regex, glob_match

    _glob_regex.cache_clear()
    monkeypatch.setattr(fnmatch, "translate", lambda pat: "(?!)")
    assert glob_match("layers.*.mlp.up_proj.weight", "layers.7.mlp.up_proj.weight")
    assert not glob_match("layers.*.weight", "layers.7.mlp.weight")
    _glob_regex.cache_clear()


def test_shard_with_specs_like_pytree(llama):
    tree = ml.specs_like(llama)
    assert set(tree) == {"model", "lm_head"}
    assert isinstance(tree["model"]["layers"], list) and len(tree["model"]["layers"]) == 2
    assert tree["model"]["layers"][0]["mlp"]["up_proj"]["weight"] == P()
    tree["model"]["layers"][1]["mlp"]["up_proj"]["weight"] = P("mlp", "embed")
    tree["lm_head"]["weight"] = P("vocab")
    plan = ml.plan(llama, ml.shard(tree, Rules(mlp="tp", vocab="tp", embed="dp")), MESH)
    sharded = {e.fqn: e.mesh_spec for e in plan if e.mesh_spec != P()}
    assert sharded == {"model.layers.1.mlp.up_proj.weight": P("tp", "dp"),
                       "lm_head.weight": P("tp")}
    # specs_like with a fill value covers every parameter
    full = ml.specs_like(llama, fill=P("dp"))
    plan = ml.plan(llama, ml.shard(full), MESH)
    assert all(e.mesh_spec == P("dp") for e in plan)


def test_spec_tree_with_bad_leaf(llama):
    tree = ml.specs_like(llama)
    tree["lm_head"]["weight"] = "tp"
    with pytest.raises(SpecError, match="lm_head.weight"):
        ml.shard(tree)(ml.trace(llama))


def test_two_transforms_claiming_one_tensor(llama):
    a = ml.shard({"lm_head.weight": P("tp")})
    b = ml.shard({"lm_head.weight": P(None, "tp")})
    with pytest.raises(PlanError, match="lm_head.weight"):
        ml.plan(llama, a | b, MESH)
    # a policy and a glob claiming one tensor differently
    with pytest.raises(PlanError, match="lm_head.weight"):
        ml.plan(llama, ml.shard(ml.policies.auto, TP_DP_RULES) | b, MESH)
    # agreeing transforms compose
    plan = ml.plan(llama, a | ml.shard({"lm_head.weight": P("tp", None),
                                       "model.norm.weight": P("dp")}), MESH)
    assert plan["lm_head.weight"].mesh_spec == P("tp")
    assert plan["model.norm.weight"].mesh_spec == P("dp")
    assert len(plan.transforms) == 2


def test_conflicting_rules_across_transforms(llama):
    a = ml.shard({"lm_head.weight": P("vocab")}, Rules(vocab="tp"))
    b = ml.shard({"model.norm.weight": P("vocab")}, Rules(vocab="dp"))
    with pytest.raises(ml.RulesError):
        ml.plan(llama, a | b, MESH)


def test_tied_params_need_the_same_spec(llama_tied):
    with pytest.raises(PlanError, match="tied"):
        ml.plan(llama_tied, ml.shard({"lm_head.weight": P("tp")}), MESH)
    plan = ml.plan(llama_tied, ml.shard({"lm_head.weight": P("tp"),
                                         "model.embed_tokens.weight": P("tp")}), MESH)
    assert plan["lm_head.weight"].mesh_spec == P("tp")


def test_plan_needs_a_mesh(llama):
    with pytest.raises(ml.MeshError):
        ml.plan(llama, ml.shard({"lm_head.weight": P("tp")}))
    with MESH:
        plan = ml.plan(llama, ml.shard({"lm_head.weight": P("tp")}))
    assert plan.mesh_shape == MESH.shape
    with pytest.raises(TypeError):
        ml.plan(llama, {"lm_head.weight": P("tp")}, MESH)
    with pytest.raises(PlanError):
        ml.trace(llama).mesh_shape


def test_plan_accepts_a_plan(llama):
    traced = ml.trace(llama)
    a = ml.plan(traced, ml.shard({"lm_head.weight": P("tp")}), MESH)
    b = ml.plan(llama, ml.shard({"lm_head.weight": P("tp")}), MESH)
    assert a == b


# ---------------------------------------------------------------------------------------
# bind errors
# ---------------------------------------------------------------------------------------

def test_bind_unknown_axis():
    m = _meta(Tiny)
    with pytest.raises(SpecError) as ei:
        ml.plan(m, ml.shard({"a.weight": P("sp", None)}), MESH)
    msg = str(ei.value)
    assert "a.weight" in msg and "(6, 8)" in msg and "P('sp', None)" in msg and "'sp'" in msg


def test_bind_spec_longer_than_tensor():
    m = _meta(Tiny)
    with pytest.raises(SpecError) as ei:
        ml.plan(m, ml.shard({"a.bias": P("tp", "dp")}), MESH)
    msg = str(ei.value)
    assert "a.bias" in msg and "(6,)" in msg and "P('tp', 'dp')" in msg


def test_bind_axes_against_mesh_order():
    with pytest.raises(SpecError, match="mesh order"):
        ml.plan(_meta(Tiny), ml.shard({"a.weight": P(("tp", "dp"))}), MESH)


@pytest.mark.parametrize("spec, rules, shown", [
    (P("tp"), None, "P('tp')"),
    (P("mlp"), Rules(mlp="tp"), "P('mlp')"),
])
def test_bind_non_divisible(spec, rules, shown):
    m = _meta(Tiny)
    with pytest.raises(SpecError) as ei:
        ml.plan(m, ml.shard({"n": spec}, rules), ml.Mesh(dp=2, tp=2, fake=True))
    msg = str(ei.value)
    assert "n (5,)" in msg                # the FQN and its shape
    assert shown in msg                   # the spec as written
    assert "'tp' (size 2)" in msg         # the axis and its size
    assert "uneven=True" in msg           # and the way out
    plan = ml.plan(m, ml.shard({"n": spec}, rules), MESH, uneven=True)
    assert plan.uneven
    assert plan["n"].mesh_spec == P("tp")
    assert plan.local_shape("n") == (3,)
    # bind(..., uneven=True) directly as well
    traced = ml.shard({"n": spec}, rules)(ml.trace(m))
    assert traced.bind(MESH, uneven=True)["n"].mesh_spec == P("tp")
    with pytest.raises(SpecError):
        traced.bind(MESH)


def test_bind_non_divisible_two_axes():
    m = _meta(Tiny)
    with pytest.raises(SpecError) as ei:
        ml.plan(m, ml.shard({"a.weight": P(("dp", "tp"))}), ml.Mesh(dp=2, tp=2, fake=True))
    msg = str(ei.value)
    assert "a.weight (6, 8)" in msg and "'dp' (size 2)" in msg and "'tp' (size 2)" in msg
    assert "6 % 4" in msg and "uneven=True" in msg


def test_bind_accepts_plain_axis_pairs(llama):
    traced = ml.shard(ml.policies.auto, TP_DP_RULES)(ml.trace(llama))
    assert traced.bind((("dp", 2), ("tp", 2))) == traced.bind(MESH)


# ---------------------------------------------------------------------------------------
# diff, JSON, rendering
# ---------------------------------------------------------------------------------------

def test_diff_between_meshes(llama):
    t = ml.shard(ml.policies.auto, TP_DP_RULES)
    a = ml.plan(llama, t, MESH)
    # same axis names, other sizes: mesh specs unchanged, only the mesh differs
    b = ml.plan(llama, t, ml.Mesh(dp=4, tp=2, fake=True))
    d = a.diff(b)
    assert d and d.changed == () and d.mesh == (a.mesh, b.mesh)
    # no 'dp' axis: every parameter that used it changes, in plan order
    # (the rules say how to lay out without it: a fallback ending in None)
    loose = Rules(batch=("dp", None), heads="tp", kv_heads="tp", mlp="tp", vocab="tp",
                  embed=("dp", None))
    c = ml.plan(llama, ml.shard(ml.policies.auto, loose), ml.Mesh(tp=4, fake=True))
    d = a.diff(c)
    changed = [fqn for fqn, _ in d.changed]
    assert changed == [e.fqn for e in a if "dp" in e.mesh_spec.axes]
    assert len(changed) == len(a)                       # every param used dp here
    fields = dict(d.changed)["lm_head.weight"]
    assert fields == (("mesh_spec", P("tp", "dp"), P("tp", None)),)
    assert d.removed == () and d.added == ()
    assert "lm_head.weight" in str(d)
    assert not a.diff(a)


def test_diff_between_specs(llama):
    a = ml.plan(llama, ml.shard({"lm_head.weight": P("tp"), "model.norm.weight": P("dp")}), MESH)
    b = ml.plan(llama, ml.shard({"lm_head.weight": P(None, "tp"),
                                 "model.norm.weight": P("dp")}), MESH)
    d = a.diff(b)
    assert [f for f, _ in d.changed] == ["lm_head.weight"]
    names = [f[0] for f in dict(d.changed)["lm_head.weight"]]
    assert names == ["spec", "mesh_spec"]
    assert d.mesh is None


def test_diff_added_removed():
    a = ml.trace(_meta(Tiny))
    b = ml.trace(_meta(TiedLM))
    d = a.diff(b)
    assert a.fqns == ("n", "f", "a.weight", "a.bias")    # own params before submodules
    assert d.removed == a.fqns
    assert d.added == b.fqns
    assert d.changed == ()


def test_diff_options(llama):
    # Options are the typed transform values, looked up by type.
    from meshlab.transforms import ZeroShard

    a = ml.trace(llama)
    b = ml.zero_shard(1, "dp")(a)
    d = a.diff(b)
    assert d.options == (("zero", None, ml.zero_shard(1, "dp")),)
    assert b.get(ZeroShard) == ml.zero_shard(1, "dp")


@pytest.mark.parametrize("which", ["llama", "llama_tied", "qwen2"])
def test_json_round_trip(which, request):
    model = request.getfixturevalue(which)
    traced = ml.trace(model)
    assert ml.Plan.from_json(traced.to_json()) == traced
    p = ml.plan(model, ml.shard(ml.policies.auto, TP_DP_RULES), MESH)
    again = ml.Plan.from_json(p.to_json())
    assert again == p
    assert again.diff(p).__bool__() is False
    assert again.memory() == p.memory()
    p = (ml.zero_shard(2, ("dp", "tp")) | ml.precision("bf16") | ml.remat("full"))(p)
    assert ml.Plan.from_json(p.to_json(indent=1)) == p


def test_json_rejects_other_formats():
    with pytest.raises(PlanError, match="meshlab.plan/1"):
        ml.Plan.from_json('{"format": "something/2"}')


def test_str_plan_shows_patterns(llama):
    p = ml.plan(llama, ml.shard(ml.policies.auto, TP_DP_RULES), MESH)
    text = str(p)
    assert "LlamaForCausalLM" in text and "Mesh(dp=2, tp=2)" in text
    for pattern in ("model.embed_tokens.weight", "model.layers.*.self_attn.q_proj.weight",
                    "model.layers.*.mlp.down_proj.weight", "model.norm.weight",
                    "lm_head.weight"):
        assert pattern in text
    assert "model.layers.0." not in text and "model.layers.1." not in text   # collapsed
    assert "f32[128@tp,64@dp]" in text                                      # a type string
    full = p.table(collapse=False)
    assert full.row_count == len(p)


def test_str_plan_shows_every_fqn_pattern_in_full(llama):
    # Every collapsed parameter name must be readable in the text rendering; a long one
    # ('model.layers.*.post_attention_layernorm.weight') must not be cut to '...wei…'.
    p = ml.plan(llama, ml.shard(ml.policies.auto, TP_DP_RULES), MESH)
    text = str(p)
    patterns = {e.fqn.replace(".0.", ".*.").replace(".1.", ".*.") for e in p}
    missing = sorted(x for x in patterns if x not in text)
    assert missing == []


# ---------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------

TINY_SPECS = {"a.weight": P("tp", "dp"), "a.bias": P("tp"), "n": P("tp"), "f": P("dp")}


def test_memory_exact_bytes_fp32():
    # On Mesh(dp=2, tp=2), per rank:
    #   a.weight (6, 8) P('tp','dp') -> (3, 4) = 12 elements
    #   a.bias   (6,)   P('tp')      -> (3,)   =  3
    #   n        (5,)   P('tp')      -> ceil(5/2) = 3 (uneven: the largest shard)
    #   f        (4, 4) P('dp')      -> (2, 4) =  8, frozen: no grads, no optimizer state
    # params 26 * 4 B; grads 18 * 4 B; AdamW: 2 fp32 moments * 18 * 4 B, no master (fp32).
    plan = ml.plan(_meta(Tiny), ml.shard(TINY_SPECS), MESH, uneven=True)
    mem = plan.memory()
    assert mem.params == 26 * 4 == 104
    assert mem.grads == 18 * 4 == 72
    assert mem.optimizer == 2 * 18 * 4 == 144
    assert mem.total == 320
    assert mem.by_category == {"params": {"float32": 104}, "grads": {"float32": 72},
                               "optimizer": {"float32": 144}}
    assert plan.memory(optimizer="sgd").optimizer == 0
    assert plan.memory(optimizer="sgd_momentum").optimizer == 18 * 4
    with pytest.raises(ValueError):
        plan.memory(optimizer="lion9000")
    assert "memory per rank" in str(mem)


def test_memory_uneven_uses_ceil():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.v = nn.Parameter(torch.ones(7))       # over dp x tp = 4: ceil(ceil(7/2)/2) = 2
            self.w = nn.Parameter(torch.ones(5, 3))    # over tp = 4: ceil(5/4) = 2 rows
    plan = ml.plan(_meta(Odd), ml.shard({"v": P(("dp", "tp")), "w": P("tp")}),
                   ml.Mesh(dp=2, tp=4, fake=True), uneven=True)
    assert plan.local_shape("v") == (1,)           # ceil(ceil(7/2) / 4) = 1
    assert plan.local_shape("w") == (2, 3)
    assert plan.memory().params == (1 + 6) * 4
    plan = ml.plan(_meta(Odd), ml.shard({"v": P(("dp", "tp")), "w": P("tp")}),
                   ml.Mesh(dp=2, tp=2, fake=True), uneven=True)
    assert plan.local_shape("v") == (2,)           # ceil(ceil(7/2) / 2) = 2
    assert plan.local_shape("w") == (3, 3)
    assert plan.memory().params == (2 + 9) * 4


def test_memory_bf16_keeps_bf16_moments():
    plan = ml.plan(_meta(Tiny, torch.bfloat16), ml.shard(TINY_SPECS), MESH, uneven=True)
    mem = plan.memory()
    assert mem.by_category["params"] == {"bfloat16": 26 * 2}
    assert mem.by_category["grads"] == {"bfloat16": 18 * 2}
    # torch's AdamW keeps its two moments in the parameter's dtype
    assert mem.by_category["optimizer"] == {"bfloat16": 2 * 18 * 2}


def test_memory_counts_tied_once():
    specs = {"emb.weight": P("tp"), "head.weight": P("tp"), "blocks.*.weight": P("dp"),
             "blocks.*.bias": P("dp")}
    plan = ml.plan(_meta(TiedLM), ml.shard(specs), MESH)
    # emb (10, 4) over tp=2: 20; three Linear(4, 4) over dp=2: 3 * (8 + 2) = 30
    assert plan.memory().params == (20 + 30) * 4


def test_memory_replicated_is_everything():
    m = _meta(Tiny)
    plan = ml.plan(m, None, MESH)
    total = sum(p.numel() for p in m.parameters())
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert plan.memory().params == 4 * total
    assert plan.memory().grads == 4 * trainable


# ---------------------------------------------------------------------------------------
# a 70B model on 16,384 ranks
# ---------------------------------------------------------------------------------------

def test_llama3_70b_on_16384_ranks_is_fast_and_exact():
    t0 = time.perf_counter()
    h, i, heads, kv_heads, vocab, layers = 8192, 28672, 64, 8, 128256, 80
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=i,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, vocab_size=vocab,
                                   tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    mesh = ml.Mesh(dp=2048, tp=8, fake=True)
    rules = Rules(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed="dp")
    plan = ml.plan(model, ml.shard(ml.policies.auto, rules), mesh)
    mem = plan.memory()
    elapsed = time.perf_counter() - t0
    assert elapsed < 20, f"build + plan + memory took {elapsed:.1f} s"
    assert mesh.size == 16384

    # Analytical per-rank parameter bytes (bf16 = 2 bytes per element):
    #   head_dim = h / heads = 128, so k/v have kv_heads * 128 = 1024 rows.
    #   Every 2-D weight is split over dp x tp = 16,384 ranks (all dims divide evenly):
    #     per layer: q, o: h*h each; k, v: 1024*h each; gate, up, down: h*i each
    #     plus embed_tokens and lm_head: vocab*h each (untied)
    #   Every 1-D norm weight (h = 8192) is split over dp = 2048 only:
    #     2 per layer + the final norm = 2*80 + 1 = 161 of them.
    #   params = 2 * [ (80*(2*h*h + 2*1024*h + 3*h*i) + 2*vocab*h) / 16384 + 161*h / 2048 ]
    kv = kv_heads * (h // heads)
    two_d = layers * (2 * h * h + 2 * kv * h + 3 * h * i) + 2 * vocab * h
    one_d = (2 * layers + 1) * h
    assert two_d % 16384 == 0 and one_d % 2048 == 0
    expected = 2 * (two_d // 16384 + one_d // 2048)
    assert expected == 8_613_640
    assert mem.params == expected
    assert mem.by_category["params"] == {"bfloat16": expected}
    assert mem.grads == expected
    # AdamW on bf16 params: 2 moments, each like the parameter
    assert mem.optimizer == 2 * expected
    assert len(plan) == 2 + layers * 9 + 1


# ---------------------------------------------------------------------------------------
# pipeline ranks: point-to-point traffic, the blocks a rank runs, stage bytes; diff per rank
# ---------------------------------------------------------------------------------------

TP_ONLY = Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)


@pytest.fixture(scope="module")
def llama8():
    """Eight equal blocks of hidden 64 (fp32): a pipeline of 4 stages takes 2 each."""
    return _hf(transformers.LlamaConfig, tie_word_embeddings=False,
               **{**TINY, "num_hidden_layers": 8})


def _pp(model, schedule, m, mesh, spec=None):
    pipe = ml.pipeline("pp", schedule=schedule, microbatches=m)
    return ml.plan(model, pipe if spec is None else spec | pipe, mesh)


def test_pipeline_p2p_1f1b(llama8):
    # batch 8 x seq 16 in 4 microbatches: 32 tokens x hidden 64 x 4 bytes per message
    p = _pp(llama8, "1f1b", 4, ml.Mesh(pp=4, fake=True))
    one = 32 * 64 * 4
    c = p.comm(batch=8, seq=16)                 # default: the busiest rank, a middle one
    assert (c.count("send", "pp"), c.bytes("send", "pp")) == (2 * 4, 2 * 4 * one)
    assert (c.count("recv", "pp"), c.bytes("recv", "pp")) == (2 * 4, 2 * 4 * one)
    assert c.ops[("all_reduce", "pp")] == (1, 8)                   # the step's loss
    for r, sides in ((0, 1), (1, 2), (2, 2), (3, 1)):   # the ends sit on one boundary
        c = p.comm(batch=8, seq=16, coord={"pp": r})
        assert c.ops[("send", "pp")] == c.ops[("recv", "pp")] == (4 * sides, 4 * sides * one)
    assert p.local_blocks() == ("model.layers.2", "model.layers.3")
    assert p.local_blocks({"pp": 3}) == ("model.layers.6", "model.layers.7")
    assert ("send", "pp") not in p.comm().ops                     # no activations given


@pytest.mark.parametrize("schedule,v", [("interleaved", 2), ("zbv", 2)])
def test_pipeline_p2p_virtual_stages(llama8, schedule, v):
    m = 8
    one = (8 * 16 // m) * 64 * 4
    p = _pp(llama8, schedule, m, ml.Mesh(pp=4, fake=True))
    from meshlab.transforms.pipeline import stages

    ranks = [s.rank for s in stages(p)]
    if schedule == "interleaved":
        # stages on ranks 0 1 2 3 0 1 2 3: rank 0 sits on boundaries 0|1, 3|4, 4|5; rank 1
        # on 0|1, 1|2, 4|5, 5|6
        assert ranks == [0, 1, 2, 3, 0, 1, 2, 3]
        sides = {0: 3, 1: 4, 2: 4, 3: 3}
    else:
        # the V: 0 1 2 3 3 2 1 0; stages 3 and 4 share rank 3 and exchange nothing
        assert ranks == [0, 1, 2, 3, 3, 2, 1, 0]
        sides = {0: 2, 1: 4, 2: 4, 3: 2}
    for r, k in sides.items():
        c = p.comm(batch=8, seq=16, coord={"pp": r})
        assert c.ops[("send", "pp")] == c.ops[("recv", "pp")] == (k * m, k * m * one)
    busiest = p.comm(batch=8, seq=16)
    assert busiest.ops[("send", "pp")] == (4 * m, 4 * m * one)
    assert len(p.local_blocks()) == 2


def test_pipeline_p2p_dtype_is_the_residual_streams(llama8):
    """precision's autocast leaves the hidden states between blocks in the parameters'
    dtype (fp32 here; what a real run sends); a bf16 model sends bf16."""
    mesh = ml.Mesh(pp=4, fake=True)
    fp32 = _pp(llama8, "1f1b", 4, mesh).comm(batch=8, seq=16).bytes("send")
    autocast = _pp(llama8, "1f1b", 4, mesh, ml.precision("bf16")).comm(batch=8, seq=16)
    assert autocast.bytes("send") == fp32 == 8 * 32 * 64 * 4
    bf16 = _hf(transformers.LlamaConfig, dtype=torch.bfloat16, tie_word_embeddings=False,
               **{**TINY, "num_hidden_layers": 8})
    assert _pp(bf16, "1f1b", 4, mesh).comm(batch=8, seq=16).bytes("send") == fp32 // 2


def test_tp_all_reduces_count_the_blocks_of_the_rank(llama8):
    # pp=4 x tp=2, 8 blocks (2 per rank), 4 microbatches of 2 x 16 tokens; per microbatch
    # 4 all-reduces of T h per block, the embedding's on the first rank, the head input's
    # and the loss's 3 (of T' = 2 x 15 scalars) on the last
    m, L, act, loss = 4, 2, 32 * 64 * 4, 2 * 15 * 4
    p = _pp(llama8, "1f1b", m, ml.Mesh(pp=4, tp=2, fake=True), ml.shard(ml.policies.auto, TP_ONLY))
    want = {0: (m * (4 * L + 1), m * (4 * L + 1) * act),
            1: (m * 4 * L, m * 4 * L * act), 2: (m * 4 * L, m * 4 * L * act),
            3: (m * (4 * L + 1) + 3 * m, m * (4 * L + 1) * act + 3 * m * loss)}
    for r, (count, nbytes) in want.items():
        c = p.comm(batch=8, seq=16, coord={"pp": r, "tp": 0})
        assert c.ops[("all_reduce", "tp")] == (count, nbytes), r
        assert len(p.local_blocks({"pp": r})) == L
    assert p.comm(batch=8, seq=16).ops[("all_reduce", "tp")] == want[1]   # the busiest
    # without a pipeline every rank runs all 8 blocks, the ends included, in one batch
    q = ml.plan(llama8, ml.shard(ml.policies.auto, TP_ONLY), ml.Mesh(tp=2, fake=True))
    assert q.local_blocks() == q.model.blocks
    act1 = 8 * 16 * 64 * 4
    assert q.comm(batch=8, seq=16).ops[("all_reduce", "tp")] == (
        4 * 8 + 2 + 3, (4 * 8 + 2) * act1 + 3 * 8 * 15 * 4)


def test_stage_table_shows_one_ranks_bytes(llama8):
    from meshlab.core.units import fmt_bytes as _fmt_bytes
    from meshlab.planning.view import render_text
    from meshlab.transforms.pipeline import stage_table, stages
    from meshlab.transforms.pipeline._schedule import stage_rank_bytes

    p = _pp(llama8, "1f1b", 4, ml.Mesh(pp=2, tp=2, fake=True), ml.shard(ml.policies.auto, TP_ONLY))
    # one block over tp=2 (fp32): q, o 32 x 64; k, v 16 x 64; gate, up, down 64 x 64; norms
    block = 4 * (2 * 32 * 64 + 2 * 16 * 64 + 3 * 64 * 64 + 2 * 64)
    embed = head = 4 * 128 * 64                              # vocab 256 over tp=2
    st = stages(p)
    assert [len(s.blocks) for s in st] == [4, 4]
    assert stage_rank_bytes(p, st[0]) == 4 * block + embed
    assert stage_rank_bytes(p, st[1]) == 4 * block + head + 4 * 64     # + the final norm
    text = render_text(stage_table(p))
    assert "params per rank" in text
    assert _fmt_bytes(4 * block + embed) in text and _fmt_bytes(4 * block + head + 256) in text
    assert p.memory().params == 4 * block + head + 256        # memory: the heavier rank


@pytest.fixture(scope="module")
def llama_8kv():
    """Eight K/V heads: tp=4 and tp=8 both split them."""
    return _hf(transformers.LlamaConfig, tie_word_embeddings=False,
               **{**TINY, "num_attention_heads": 8, "num_key_value_heads": 8})


def test_diff_tp4_tp8_shows_local_shapes_and_bytes(llama_8kv):
    t = ml.shard(ml.policies.auto, TP_ONLY)
    a = ml.plan(llama_8kv, t, ml.Mesh(tp=4, fake=True))
    b = ml.plan(llama_8kv, t, ml.Mesh(tp=8, fake=True))
    d = a.diff(b)
    assert d.changed == () and d.mesh == (a.mesh, b.mesh)
    local = {fqn: rest for fqn, *rest in d.local}
    assert local["model.layers.0.self_attn.q_proj.weight"] == [(16, 64), (8, 64), 4096, 2048]
    assert local["model.layers.1.mlp.down_proj.weight"] == [(64, 32), (64, 16), 8192, 4096]
    assert local["lm_head.weight"] == [(64, 64), (32, 64), 16384, 8192]
    assert "model.norm.weight" not in local                     # replicated either way
    assert d.memory == tuple((c, getattr(a.memory(), c), getattr(b.memory(), c))
                             for c in ("params", "grads", "optimizer"))
    text = str(d)
    assert "model.layers.*.self_attn.q_proj.weight (×2)" in text
    assert "(16, 64) 4.00 KiB" in text
    assert "(8, 64) 2.00 KiB" in text and "(per rank) params" in text
    html = d._repr_html_()
    assert "(8, 64) 2.00 KiB" in html and "(per rank) optimizer" in html
    assert not a.diff(a) and a.diff(a).local == () and a.diff(a).memory == ()


def test_diff_zero1_zero3_shows_the_dim0_split(llama):
    t = ml.shard(ml.policies.auto, TP_ONLY)
    a = ml.plan(llama, t | ml.zero_shard(1, "dp"), MESH)
    b = ml.plan(llama, t | ml.zero_shard(3, "dp"), MESH)
    d = a.diff(b)
    assert d.options == (("zero", ml.zero_shard(1, "dp"), ml.zero_shard(3, "dp")),)
    assert d.changed == () and d.mesh is None
    local = {fqn: rest for fqn, *rest in d.local}
    # ZeRO-3 splits dim 0 of the tp-local shard over dp=2 (parameters stay fp32)
    assert local["model.layers.0.self_attn.q_proj.weight"] == [(32, 64), (16, 64), 8192, 4096]
    assert local["model.norm.weight"] == [(64,), (32,), 256, 128]
    assert len(local) == len(a)                              # every parameter is split
    before, after = a.memory(), b.memory()
    assert d.memory == (("params", before.params, after.params),
                        ("grads", before.grads, after.grads),
                        ("optimizer", before.optimizer, after.optimizer))
    assert after.params * 2 == before.params
    text = str(d)
    assert "option zero" in text and "(64,) 256 B" in text and "(32,) 128 B" in text


def test_the_table_counts_what_memory_counts():
    """The plan table's bytes per rank are what ``plan.memory()`` counts for parameters:
    under ZeRO-3 each rank's share of the shards, not the tensor-parallel shard whole."""
    from meshlab.planning.view import plan_cells
    from tests import _models as M

    p = ml.plan(M.build("llama"), ml.zero_shard(3, "dp"), ml.Mesh(dp=4, fake=True))
    header, rows, _ = plan_cells(p, collapse=False)
    col = header.index("bytes/rank")
    shown = {r[0]: r[col] for r in rows}
    params = sum(p.memory().by_category["params"].values())
    assert sum(e.numel for e in p if not e.tied_to) * 4 > 3 * params     # ZeRO-3 splits them
    held = sum(_bytes(v) for v in shown.values())
    assert abs(held - params) <= 0.01 * params + 64 * len(shown), (held, params)


def _bytes(text: str) -> float:
    n, unit = text.split()
    return float(n) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_the_uneven_hint_names_the_public_calls():
    from tests import _models as M

    with pytest.raises(ml.SpecError, match=r"meshlab\.plan\(\.\.\., uneven=True\)"):
        ml.plan(M.build("llama"), ml.shard({"lm_head.weight": ml.P("tp")}),
                ml.Mesh(tp=7, fake=True))
