"""Tiny configs of any Hugging Face family: the default config's (or a given config's)
size fields shrunk (only the fields the family's config has), per-layer lists cut to the
layer count, dropout off. The family walk (``meshlab.testing``) trains models built from
them; a pipeline's plan checks its stages on one (``transforms.pipeline``)."""

from __future__ import annotations

VOCAB = 128
LAYERS = 2
# field -> tiny value, set only where the family's config has the field
_SMALL = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=VOCAB, num_hidden_layers=LAYERS,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, moe_num_experts=4,
    # multi-head latent attention
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # dropout off: the parity run compares numbers
    attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    max_position_embeddings=64, rotary_dim=8,
)


class TinyConfigError(Exception):
    """The walk could not build a tiny model of this family."""


def _layer_lists(have: dict, n_layers) -> dict:
    """Per-layer lists cut to ``LAYERS``, keeping each kind of layer the family mixes
    (a hybrid's attention and linear-attention layers both appear)."""
    out = {}
    for key, v in have.items():
        if not isinstance(v, list) or not v or len(v) != n_layers:
            continue
        kinds = list(dict.fromkeys(map(str, v)))
        if key.endswith("types") and len(kinds) > 1:
            first = {str(x): x for x in reversed(v)}
            out[key] = ([first[k] for k in kinds] * LAYERS)[:LAYERS]
        else:
            out[key] = v[:LAYERS]
    return out


def _rope(have: dict, head_dim: int) -> dict:
    """Multimodal rotary sections rescaled to the tiny head width."""
    rp = have.get("rope_parameters")
    if not isinstance(rp, dict) or not isinstance(rp.get("mrope_section"), list):
        return {}
    sec = rp["mrope_section"]
    scale = (head_dim // 2) / sum(sec)
    new = [max(1, int(x * scale)) for x in sec]
    new[0] += head_dim // 2 - sum(new)
    return {"rope_parameters": {**rp, "mrope_section": new}}


def tiny_config(model_type: str, base=None):
    """``model_type``'s default config (or ``base``, a config of that family) with its size
    fields shrunk, its per-layer lists cut and its dropout off."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]() if base is None else base
    have = cfg.to_dict()
    alias = dict(getattr(cfg, "attribute_map", {}) or {})       # hidden_size -> n_embd
    kw = {alias.get(k, k): v for k, v in _SMALL.items() if alias.get(k, k) in have}
    if "qk_rope_head_dim" in have and "head_dim" in have:
        kw["head_dim"] = kw["qk_rope_head_dim"]          # MLA: rotary width is head_dim
    if "kv_lora_rank" in have and "num_key_value_heads" in have:
        kw["num_key_value_heads"] = kw["num_attention_heads"]   # MLA: one K/V per head
    if "qk_head_dim" in have:
        kw["qk_head_dim"] = kw.get("qk_nope_head_dim", 8) + kw.get("qk_rope_head_dim", 8)
    for key in ("attn_layer_period", "expert_layer_period"):   # hybrids: both kinds in 2
        if key in have:
            kw[key], kw[key.replace("period", "offset")] = 2, 1
    for k, v in have.items():
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
            kw[k] = 0.0
    kw.update(_layer_lists(have, have.get("num_hidden_layers")))
    kw.update(_rope(have, kw.get("head_dim", 16)))
    plc = have.get("per_layer_config")
    if isinstance(plc, dict):
        kw["per_layer_config"] = {k: v for k, v in plc.items() if int(k) < LAYERS}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(have.get(key), int) and have[key] >= VOCAB:
            kw[key] = 0
    try:
        return type(cfg)(**{**have, **kw})
    except Exception as e:                      # config validation of the family
        raise TinyConfigError(f"tiny config rejected: {type(e).__name__}: {e}") from None
