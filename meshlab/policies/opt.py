"""OPT: q/k/v/out_proj attention, ``fc1``/``fc2`` directly in the decoder layer, learned
positions (replicated), and an LM head tied to ``embed_tokens``.

The attention is a tensor-parallel region; the MLP has no module of its own, so ``fc1``
enters the region itself (column-parallel outside a region) and ``fc2`` joins it. The
layer flattens the hidden states to (batch x seq, hidden) before ``fc1``, so there is no
(batch, seq, hidden) module to gather a sequence shard at: under sequence parallelism
the layout check refuses ``fc1`` (ConfigError), naming it.
"""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

OPT = register("opt", Policy(
    name="opt",
    modules=(
        R("decoder.embed_tokens", "embedding_rowwise"),
        R("decoder.embed_positions", "replicate"),
        R("decoder.layers.*.self_attn.q_proj", "colwise", axis="heads"),
        R("decoder.layers.*.self_attn.k_proj", "colwise", axis="heads"),
        R("decoder.layers.*.self_attn.v_proj", "colwise", axis="heads"),
        R("decoder.layers.*.self_attn.out_proj", "rowwise", axis="heads"),
        R("decoder.layers.*.fc1", "colwise", axis="mlp"),
        R("decoder.layers.*.fc2", "rowwise", axis="mlp"),
        R("decoder.layers.*.self_attn_layer_norm", "norm"),
        R("decoder.layers.*.final_layer_norm", "norm"),
        R("decoder.final_layer_norm", "norm"),
        R("/lm_head", "vocab"),                                   # tied to embed_tokens
    ),
    activations=(("decoder.layers.*", P("batch", "seq", "embed")),),
    regions=("decoder.layers.*.self_attn",),
    sequence_parallel=("decoder.layers.*.self_attn_layer_norm",
                       "decoder.layers.*.final_layer_norm"),
    local_attrs=(("decoder.layers.*.self_attn", "num_heads"),),
    # the final norm is absent with do_layer_norm_before=False (OPT-350m)
    optional=("/lm_head", "decoder.final_layer_norm"),
))
