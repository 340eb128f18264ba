"""ViT: pre-norm encoder blocks over patch tokens (a CLS token first), a linear
classifier on the CLS token.

Attention (q/k/v over heads, o_proj joining them) and the MLP (fc1/fc2) are the two
tensor-parallel regions of each block. The patch embedding (a Conv2d), the CLS token and
position embeddings, the final norm and the classifier stay replicated: they run on the
whole activations outside the regions, so their gradients are whole on every rank.
Under sequence parallelism the blocks' layernorms see sequence shards only; the token
count (patches plus one CLS token) must divide over tp, which the sequence split checks.
"""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

VIT = register("vit", Policy(
    name="vit",
    modules=(
        R("embeddings.patch_embeddings.projection", "replicate"),
        R("layers.*.attention.q_proj", "colwise", axis="heads"),
        R("layers.*.attention.k_proj", "colwise", axis="heads"),
        R("layers.*.attention.v_proj", "colwise", axis="heads"),
        R("layers.*.attention.o_proj", "rowwise", axis="heads"),
        R("layers.*.mlp.fc1", "colwise", axis="mlp"),
        R("layers.*.mlp.fc2", "rowwise", axis="mlp"),
        R("layers.*.layernorm_before", "norm"),
        R("layers.*.layernorm_after", "norm"),
        R("layernorm", "norm"),
        R("/classifier", "replicate"),
    ),
    activations=(("layers.*", P("batch", "seq", "embed")),),
    regions=("layers.*.attention", "layers.*.mlp"),
    sequence_parallel=("layers.*.layernorm_before", "layers.*.layernorm_after"),
    # ViTAttention reshapes with -1 heads and its head_dim; the head count it keeps is
    # this rank's share.
    local_attrs=(("layers.*.attention", "num_attention_heads"),),
    optional=("/classifier",),
))
