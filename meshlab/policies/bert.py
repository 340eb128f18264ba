"""BERT: post-norm encoder blocks; the MLM head's decoder is tied to the word embeddings."""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

BERT = register("bert", Policy(
    name="bert",
    modules=(
        R("embeddings.word_embeddings", "embedding_rowwise"),
        R("encoder.layer.*.attention.self.query", "colwise", axis="heads"),
        R("encoder.layer.*.attention.self.key", "colwise", axis="heads"),
        R("encoder.layer.*.attention.self.value", "colwise", axis="heads"),
        R("encoder.layer.*.attention.output.dense", "rowwise", axis="heads"),
        R("encoder.layer.*.intermediate.dense", "colwise", axis="mlp"),
        R("encoder.layer.*.output.dense", "rowwise", axis="mlp"),
        R("encoder.layer.*.attention.output.LayerNorm", "norm"),
        R("encoder.layer.*.output.LayerNorm", "norm"),
        R("/cls.predictions.decoder", "vocab"),                 # tied to word_embeddings
    ),
    activations=(("encoder.layer.*", P("batch", "seq", "embed")),),
    regions=("encoder.layer.*.attention.self", "encoder.layer.*.intermediate"),
    # Under sequence parallelism these replicated modules see sequence shards only.
    sequence_parallel=("encoder.layer.*.attention.output.LayerNorm",
                       "encoder.layer.*.output.LayerNorm"),
    local_attrs=(("encoder.layer.*.attention.self", "num_attention_heads"),
                 ("encoder.layer.*.attention.self", "all_head_size")),
    optional=("/cls.predictions.decoder",),
))
