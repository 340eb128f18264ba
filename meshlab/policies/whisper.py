"""Whisper: a convolutional audio encoder (conv1, conv2, fixed positions) and a text
decoder with cross-attention (``encoder_attn``) on the encoder's output; the output
projection ``proj_out`` is tied to the decoder's token embedding."""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

_SELF = "*.layers.*.self_attn"
_CROSS = "decoder.layers.*.encoder_attn"

WHISPER = register("whisper", Policy(
    name="whisper",
    modules=(
        R("decoder.embed_tokens", "embedding_rowwise"),
        *(R(f"{a}.{p}_proj", "colwise", axis="heads") for a in (_SELF, _CROSS)
          for p in "qkv"),
        R(f"{_SELF}.out_proj", "rowwise", axis="heads"),
        R(f"{_CROSS}.out_proj", "rowwise", axis="heads"),
        # fc1 is in no region of its own: as a column-parallel module outside one, its
        # input enters the TP region at fc1 itself; fc2 joins it.
        R("*.layers.*.fc1", "colwise", axis="mlp"),
        R("*.layers.*.fc2", "rowwise", axis="mlp"),
        R("encoder.conv1", "replicate"), R("encoder.conv2", "replicate"),
        R("encoder.embed_positions", "replicate"), R("decoder.embed_positions", "replicate"),
        R("*.layers.*.self_attn_layer_norm", "norm"),
        R(f"{_CROSS}_layer_norm", "norm"),
        R("*.layers.*.final_layer_norm", "norm"),
        R("*.layer_norm", "norm"),
        R("/proj_out", "vocab"),                                 # tied to embed_tokens
    ),
    activations=(("encoder.layers.*", P("batch", "seq", "embed")),
                 ("decoder.layers.*", P("batch", "seq", "embed"))),
    # The cross-attention's k and v read the encoder's output, not the region's hidden
    # states: each is a region of its own, so that input enters the TP region too.
    regions=(_SELF, _CROSS, f"{_CROSS}.k_proj", f"{_CROSS}.v_proj"),
    local_attrs=((_SELF, "num_heads"), (_CROSS, "num_heads")),
    optional=("/proj_out",),
))
