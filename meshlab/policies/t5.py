"""T5 (and T5 v1.1): encoder and decoder stacks of pre-norm blocks, one shared embedding
tied to both stacks and the LM head, a per-head relative position bias in each stack's
first block, and cross-attention (``EncDecAttention``) on the encoder's output."""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

_SELF = "*.block.*.layer.0.SelfAttention"
_CROSS = "decoder.block.*.layer.1.EncDecAttention"
_FF = "*.block.*.layer.*.DenseReluDense"

T5 = register("t5", Policy(
    name="t5",
    modules=(
        R("shared", "embedding_rowwise"),
        R("encoder.embed_tokens", "embedding_rowwise"),          # tied to shared
        R("decoder.embed_tokens", "embedding_rowwise"),          # tied to shared
        *(R(f"{a}.{p}", "colwise", axis="heads") for a in (_SELF, _CROSS) for p in "qkv"),
        R(f"{_SELF}.o", "rowwise", axis="heads"),
        R(f"{_CROSS}.o", "rowwise", axis="heads"),
        # (buckets, heads), in each stack's first block: each rank looks up its own heads
        R(f"{_SELF}.relative_attention_bias", "embedding_colwise", axis="heads"),
        R(f"{_FF}.wi", "colwise", axis="mlp"),                    # T5
        R(f"{_FF}.wi_0", "colwise", axis="mlp"),                  # T5 v1.1 (gated)
        R(f"{_FF}.wi_1", "colwise", axis="mlp"),
        R(f"{_FF}.wo", "rowwise", axis="mlp"),
        R("*.block.*.layer.*.layer_norm", "norm"),
        R("*.final_layer_norm", "norm"),
        R("/lm_head", "vocab"),                                  # tied to shared
    ),
    activations=(("encoder.block.*", P("batch", "seq", "embed")),
                 ("decoder.block.*", P("batch", "seq", "embed"))),
    # The cross-attention's k and v read the encoder's output, not the region's hidden
    # states: each is a region of its own, so that input enters the TP region too (its
    # gradient is summed over tp).
    regions=(_SELF, _CROSS, f"{_CROSS}.k", f"{_CROSS}.v", _FF),
    # T5Attention builds the zero position bias of the cross-attention with n_heads.
    local_attrs=((_SELF, "n_heads"), (_SELF, "inner_dim"),
                 (_CROSS, "n_heads"), (_CROSS, "inner_dim")),
    optional=(f"{_FF}.wi", f"{_FF}.wi_0", f"{_FF}.wi_1", "/lm_head"),
))
