"""Falcon: a fused ``query_key_value`` of K/V groups, rotary or ALiBi positions, and an LM
head tied to ``word_embeddings``.

``FalconAttention`` lays the fused output out as ``num_kv_heads`` groups of (query heads
of the group, k, v): one K/V per query head (``multi_query=False``), or per group
(``new_decoder_architecture``). A contiguous split over dim 0 gives each rank whole
groups, so plain column-parallel with ``num_heads`` and ``num_kv_heads`` divided is
right where ``num_kv_heads`` divides over tp. The default ``multi_query=True`` has one
K/V head for all query heads (``num_kv_heads`` 1): the layout check refuses it
(ConfigError, naming ``num_kv_heads``). With ``alibi=True`` the model builds the biases
and the mask for every head, (batch, heads, ...); each rank's attention is passed its
own heads' share of both (``head_args``). Norm names differ by variant: each is optional.
"""

from .._spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

_NORMS = ("h.*.input_layernorm", "h.*.post_attention_layernorm", "h.*.ln_attn", "h.*.ln_mlp")

FALCON = register("falcon", Policy(
    name="falcon",
    modules=(
        R("word_embeddings", "embedding_rowwise"),
        *(R(g, "norm") for g in _NORMS), R("ln_f", "norm"),
        R("h.*.self_attention.query_key_value", "colwise", axis="heads"),
        R("h.*.self_attention.dense", "rowwise", axis="heads"),
        R("h.*.mlp.dense_h_to_4h", "colwise", axis="mlp"),
        R("h.*.mlp.dense_4h_to_h", "rowwise", axis="mlp"),
        R("/lm_head", "vocab"),                                   # tied to word_embeddings
    ),
    activations=(("h.*", P("batch", "seq", "embed")),),
    regions=("h.*.self_attention", "h.*.mlp"),
    sequence_parallel=_NORMS,
    local_attrs=(("h.*.self_attention", "num_heads"), ("h.*.self_attention", "num_kv_heads")),
    # ALiBi: (batch, heads, 1, kv) biases ((batch x heads, 1, kv) without a 4-D mask) and a
    # (batch, heads, q, kv) mask; rotary passes alibi=None and a (batch, 1, q, kv) mask,
    # which stay whole. Heads are third from the end in each.
    head_args=(("h.*.self_attention", "alibi", "num_heads", -3),
               ("h.*.self_attention", "attention_mask", "num_heads", -3)),
    optional=("/lm_head",) + _NORMS,
))
