"""Decoder-only families of the parity harness (``_families``): tiny configs and batches."""

from __future__ import annotations

import torch

import meshlab as ml

from ._families import Family

V = 97


def _ids(n, g):
    x = torch.randint(0, V, (n, 8), generator=g)
    return {"input_ids": x}


def _lm(out, batch):
    return ml.losses.causal_lm_loss(out, batch)


def _fam(**config) -> Family:
    return Family(dict(config, vocab_size=V), "AutoModelForCausalLM", _ids, _lm)


# Llama-like families (translated from their base_model_tp_plan): GQA with 2 KV heads.
_GQA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)

_FALCON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=64,
               max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)

FAMILIES = {
    "llama": _fam(model_type="llama", **_GQA),
    "mistral": _fam(model_type="mistral", **_GQA),
    "qwen2": _fam(model_type="qwen2", **_GQA),
    "qwen3": _fam(model_type="qwen3", head_dim=8, **_GQA),
    # Gemma: norms scaling by 1 + weight, a tanh-GELU gated MLP, embeddings scaled by sqrt(h)
    "gemma": _fam(model_type="gemma", head_dim=8, **_GQA),
    "cohere": _fam(model_type="cohere", **_GQA),
    "gpt2": _fam(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # GPT-J: parallel attention and MLP, rotary on the first 4 of each head's 8 features.
    "gptj": _fam(model_type="gptj", n_embd=32, n_layer=2, n_head=4, n_inner=64, rotary_dim=4,
                 n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": _fam(model_type="opt", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0,
                attention_dropout=0.0),
    # BLOOM: fused q|k|v interleaved per head, ALiBi; the MLP is 4 x hidden.
    "bloom": _fam(model_type="bloom", hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                  attention_dropout=0.0),
    # Falcon with one K/V head per query head (multi_query=False): rotary, parallel
    # attention and MLP on one input_layernorm.
    "falcon": _fam(model_type="falcon", multi_query=False, **_FALCON),
    # ALiBi: biases and mask over every head, each rank given its own heads' share
    "falcon_alibi": _fam(model_type="falcon", multi_query=False, alibi=True, **_FALCON),
    # grouped K/V (new_decoder_architecture): 2 groups of (2 query heads, k, v), ln_attn/ln_mlp
    "falcon_gqa": _fam(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2,
                       **_FALCON),
    # the default multi-query layout: one K/V head for every query head (refused)
    "falcon_mqa": _fam(model_type="falcon", **_FALCON),
}


def _mlm(out, batch):
    return ml.losses.masked_lm_loss(out, {"labels": batch["input_ids"]})


# BERT (masked LM) and the mixture-of-experts families named by the support table
FAMILIES["bert"] = Family(dict(model_type="bert", hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64, vocab_size=V,
                               max_position_embeddings=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0), "AutoModelForMaskedLM",
                          _ids, _mlm)
FAMILIES["mixtral"] = _fam(model_type="mixtral", **{**_GQA, "intermediate_size": 32},
                           num_local_experts=4, num_experts_per_tok=2)
FAMILIES["deepseek_v3"] = _fam(model_type="deepseek_v3", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=2, topk_group=1,
                               q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=8)
