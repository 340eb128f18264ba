"""SAM (Segment Anything): a windowed ViT image encoder, a prompt encoder and a mask
decoder whose two-way transformer attends tokens to the image and back.

Image encoder: each block's attention (one packed q|k|v ``qkv``, each part split over
heads, ``proj`` joining them) and MLP (``lin1``/``lin2``) are tensor-parallel regions.
The decomposed relative positions ``rel_pos_h``/``rel_pos_w`` are (positions, head_dim):
one table shared by every head, so they stay replicated and, as each rank's heads use
them, their gradients are summed over tp (``replicated_with_grad_allreduce``).

Mask decoder: every ``SamAttention`` (q/k/v to ``internal_dim``, then ``out_proj``) is
a region entered by all three of its inputs, which it takes by keyword
(``multi_input_regions``); each two-way block's MLP is a region too. The patch
embedding, neck, prompt encoder, mask upscaling, hypernetwork MLPs and IoU head are
small and stay replicated, outside every region, so their gradients are whole.

Sequence parallelism does not apply: the mask decoder's regions lie after the image
encoder's blocks, and the windowed blocks reshape the (batch, height, width, channel)
map into windows; the layout check refuses it (ConfigError).
"""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

_VIS = "vision_encoder.layers.*"
_DEC = "mask_decoder.transformer"
_ATTN = tuple(f"{_DEC}.layers.*.{a}" for a in ("self_attn", "cross_attn_token_to_image",
                                                 "cross_attn_image_to_token")) + \
    (f"{_DEC}.final_attn_token_to_image",)

SAM = register("sam", Policy(
    name="sam",
    modules=(
        R("vision_encoder.patch_embed.projection", "replicate"),
        R(f"{_VIS}.attn.qkv", "packed_qkv_colwise", axis="heads"),
        R(f"{_VIS}.attn.proj", "rowwise", axis="heads"),
        R(f"{_VIS}.attn", "replicated_with_grad_allreduce"),     # rel_pos_h, rel_pos_w
        R(f"{_VIS}.mlp.lin1", "colwise", axis="mlp"),
        R(f"{_VIS}.mlp.lin2", "rowwise", axis="mlp"),
        R(f"{_VIS}.layer_norm1", "norm"), R(f"{_VIS}.layer_norm2", "norm"),
        *(R(f"{a}.{p}_proj", "colwise", axis="heads") for a in _ATTN for p in "qkv"),
        *(R(f"{a}.out_proj", "rowwise", axis="heads") for a in _ATTN),
        R(f"{_DEC}.layers.*.mlp.lin1", "colwise", axis="mlp"),
        R(f"{_DEC}.layers.*.mlp.lin2", "rowwise", axis="mlp"),
    ),
    # the image encoder's blocks give (batch, height, width, channel)
    activations=((_VIS, P("batch", "seq", None, "embed")),),
    regions=(f"{_VIS}.attn", f"{_VIS}.mlp", f"{_DEC}.layers.*.mlp"),
    multi_input_regions=_ATTN,
    # SamVisionAttention reshapes qkv by num_attention_heads; SamAttention splits its
    # heads by num_attention_heads (internal_dim is its global q/k/v width)
    local_attrs=((f"{_VIS}.attn", "num_attention_heads"),
                 *((a, "num_attention_heads") for a in _ATTN),
                 *((a, "internal_dim") for a in _ATTN)),
))
