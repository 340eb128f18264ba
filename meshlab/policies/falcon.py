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

from ._policy import ModuleRule as R, Policy
from ._registry import register
from .bloom import BLOOM

# The same module names as BLOOM's (its fused q|k|v, dense, MLP, tied head); the norms
# differ by variant, and K/V heads and the ALiBi mask are divided too.
_NORMS = ("h.*.ln_attn", "h.*.ln_mlp")

FALCON = register("falcon", BLOOM.without("word_embeddings_layernorm") + Policy(
    name="falcon",
    modules=tuple(R(g, "norm") for g in _NORMS),
    sequence_parallel=_NORMS,
    local_attrs=(("h.*.self_attention", "num_kv_heads"),),
    # ALiBi: (batch, heads, 1, kv) biases ((batch x heads, 1, kv) without a 4-D mask) and a
    # (batch, heads, q, kv) mask; rotary passes alibi=None and a (batch, 1, q, kv) mask,
    # which stay whole. Heads are third from the end in each.
    head_args=(("h.*.self_attention", "attention_mask", "num_heads", -3),),
    optional=("h.*.input_layernorm", "h.*.post_attention_layernorm") + _NORMS,
))
