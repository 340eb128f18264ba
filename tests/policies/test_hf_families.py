"""Every dense family whose config carries a ``base_model_tp_plan`` plans and lays out
under ``policies.auto`` — or is refused with a typed error that names the reason."""

from __future__ import annotations

import pytest
import torch

import meshlab as ml
from meshlab.transforms.shard._layout import tp_layout

RULES = ml.Rules(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
MESH = ml.Mesh(dp=2, tp=2, fake=True)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, head_dim=16)

# Families whose plan names only projections meshlab translates, on tiny configs.
DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite",
         "cohere", "olmo", "phi", "starcoder2", "helium", "nemotron", "exaone4", "ernie4_5"]


def _build(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **SMALL)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family", DENSE)
def test_family_plans_under_auto(family):
    model = _build(family)
    p = ml.plan(model, ml.shard(ml.policies.auto, RULES), MESH)
    layout, _ = tp_layout(p, 0)
    styled = [e for e in p if set(e.tags) & {"colwise", "rowwise"} and e.fqn.endswith("weight")]
    assert styled, "the family's tp plan was not applied"
    for e in styled:
        assert "tp" in e.mesh_spec.axes or "kv_replicated" in e.tags, e
    assert layout is not None and layout.regions


def test_norms_after_gathered_projections_see_every_head():
    # OLMo-2 normalizes q over all heads at once; its plan gathers q/k/v again
    # (colwise_gather_output) and slices o_proj's input (rowwise_split_input), so the
    # norm sees every head and its gradient is whole: not summed over tp, and exact (the
    # family walk trains it to the one-process numbers).
    from meshlab.policies import _support

    model = _build("olmo2")
    p = ml.plan(model, ml.shard(ml.policies.auto, RULES), MESH)
    layout, reduce = tp_layout(p, 0)
    styles = {m.fqn: m.style for m in layout.modules}
    assert styles["model.layers.0.self_attn.q_proj"].gather_output
    assert styles["model.layers.0.self_attn.o_proj"].split_input
    assert not any("q_norm" in f for f in reduce)
    assert _support.load()["families"]["olmo2"]["outcome"] == "trained"
    # as plain colwise/rowwise (the styles' names lost), the same norm would see only
    # this rank's heads: refused, never trained silently wrong
    plain = {g: s.replace("_gather_output", "").replace("_split_input", "")
             for g, s in model.config.base_model_tp_plan.items()}
    with pytest.raises(ml.ConfigError, match="q_norm"):
        ml.plan(model, ml.shard(ml.policies.get("olmo2", plain), RULES), MESH)


def test_moe_plans_leave_the_experts_to_expert_route():
    """A mixture-of-experts tp plan: attention and shared experts sharded as it says; the
    experts (and their ``moe_tp_experts`` style) are left out, replicated over tp, and the
    MoE block is no tensor-parallel region (its shared expert is one)."""
    from transformers import AutoConfig

    pol = ml.policies.from_hf_tp_plan("qwen2_moe", AutoConfig.for_model("qwen2_moe")
                                      .base_model_tp_plan)
    globs = {r.glob: r.style for r in pol.modules}
    assert not any("experts" in g.split(".") for g in globs)
    assert globs["layers.*.self_attn.q_proj"] == "colwise"
    assert pol.regions == ("layers.*.self_attn",)
    ds = ml.policies.from_hf_tp_plan("deepseek_v3", AutoConfig.for_model("deepseek_v3")
                                     .base_model_tp_plan)
    assert "layers.*.mlp" not in ds.regions and "layers.*.mlp.shared_experts" in ds.regions


def test_unknown_styles_are_named_in_the_error():
    with pytest.raises(ml.PolicyError, match="moe_weird"):
        ml.policies.from_hf_tp_plan("x", {"layers.*.mlp.router": "moe_weird"})
