"""BLOOM: a fused ``query_key_value`` laid out per head as [q, k, v], ALiBi biases, and an
LM head tied to ``word_embeddings``.

``BloomAttention`` views the fused output as (batch, seq, heads, 3, head_dim), so a
contiguous split over dim 0 gives each rank whole heads with their own q, k and v (plain
column-parallel, not packed). The model builds the ALiBi tensor for every head, (batch x
heads, 1, seq), from the global head count; each rank's attention is passed its own
heads' rows (``head_args``). Attention and MLP add the residual after their row-parallel
projection, inside the region, on this rank's rows (or sequence shard).
"""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

BLOOM = register("bloom", Policy(
    name="bloom",
    modules=(
        R("word_embeddings", "embedding_rowwise"),
        R("word_embeddings_layernorm", "norm"),
        R("h.*.input_layernorm", "norm"), R("h.*.post_attention_layernorm", "norm"),
        R("ln_f", "norm"),
        R("h.*.self_attention.query_key_value", "colwise", axis="heads"),
        R("h.*.self_attention.dense", "rowwise", axis="heads"),
        R("h.*.mlp.dense_h_to_4h", "colwise", axis="mlp"),
        R("h.*.mlp.dense_4h_to_h", "rowwise", axis="mlp"),
        R("/lm_head", "vocab"),                                   # tied to word_embeddings
    ),
    activations=(("h.*", P("batch", "seq", "embed")),),
    regions=("h.*.self_attention", "h.*.mlp"),
    sequence_parallel=("h.*.input_layernorm", "h.*.post_attention_layernorm"),
    local_attrs=(("h.*.self_attention", "num_heads"),),
    head_args=(("h.*.self_attention", "alibi", "num_heads", -3),),   # (batch x heads, 1, kv)
    optional=("/lm_head",),
))
