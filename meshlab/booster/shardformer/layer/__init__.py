"""``colossalai.shardformer.layer``: Colossal-AI's hand-sharded layers (``Linear1D_Col``,
``Linear1D_Row``, ``VocabParallelEmbedding1D``, ...) are not meshlab's way: a layer is
sharded by the partition spec of its weight (``shard`` with a policy or your own specs).
Importing one of Colossal-AI's names raises an ``ImportError`` that names that fix;
``layer.utils.Randomizer`` is there (``utils``)."""

from __future__ import annotations

# colossalai.shardformer.layer's names (its __all__)
_COLOSSAL = frozenset((
    "Embedding1D", "VocabParallelEmbedding1D", "LinearWithGradAccum", "Linear1D_Col",
    "Linear1D_Row", "GPT2FusedLinearConv", "GPT2FusedLinearConv1D_Row",
    "GPT2FusedLinearConv1D_Col", "DropoutForParallelInput", "DropoutForReplicatedInput",
    "cross_entropy_1d", "dist_cross_entropy", "dist_log_prob_1d", "dist_log_prob",
    "BaseLayerNorm", "LayerNorm", "RMSNorm", "FusedLayerNorm", "FusedRMSNorm",
    "FusedLinear1D_Col", "FusedLinear", "ParallelModule", "PaddingEmbedding",
    "PaddingLMHead", "VocabParallelLMHead1D", "AttnMaskType", "ColoAttention",
    "RingAttention", "get_pad_info", "all_to_all_comm", "FusedLinear1D_Row"))


def __getattr__(name: str):
    if name not in _COLOSSAL:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise ImportError(f"colossalai.shardformer.layer.{name}: meshlab has no hand-sharded "
                      f"layers; shard a plain nn.Linear / nn.Embedding by its weight's "
                      f"partition spec instead: meshlab.shard(meshlab.policies.auto, rules) "
                      f"for a Hugging Face model, or meshlab.shard({{'*.weight': "
                      f"P('tp', None)}}) for your own module")
