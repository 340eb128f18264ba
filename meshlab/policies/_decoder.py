"""The decoder policy shared by the Llama-like families (llama, mistral, qwen2, ...).

Hugging Face's ``base_model_tp_plan`` covers the projections; this adds what it leaves
out: a vocab-parallel embedding and LM head (with a parallel loss), norm weights in
the ``embed`` axis (replicated under TP rules, sharded under FSDP-style rules), and the
decoder block output as an activation boundary (``batch, seq, embed``).
"""

from ..core.spec import P
from ._policy import ModuleRule, Policy

DECODER = Policy(
    name="decoder",
    modules=(
        ModuleRule("embed_tokens", "embedding_rowwise"),
        ModuleRule("/lm_head", "vocab"),
        ModuleRule("norm", "norm"),
        ModuleRule("layers.*.input_layernorm", "norm"),
        ModuleRule("layers.*.post_attention_layernorm", "norm"),
    ),
    activations=(("layers.*", P("batch", "seq", "embed")),),
    # Sequence-sharded between the blocks' entry and exit; the final norm runs after the
    # sequence is gathered again.
    sequence_parallel=("layers.*.input_layernorm", "layers.*.post_attention_layernorm"),
    regions=("layers.*.self_attn", "layers.*.mlp"),
    # Families differ in naming; these defaults apply where the names exist.
    optional=("embed_tokens", "/lm_head", "norm", "layers.*.input_layernorm",
              "layers.*.post_attention_layernorm", "layers.*", "layers.*.self_attn",
              "layers.*.mlp"),
)
