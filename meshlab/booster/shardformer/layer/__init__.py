"""``colossalai.shardformer.layer``: Colossal-AI's hand-sharded layers (``Linear1D_Col``,
``Linear1D_Row``, ``VocabParallelEmbedding1D``, ...) are not meshlab's way: a layer is
sharded by the partition spec of its weight (``shard`` with a policy or your own specs).
Importing one raises an ``ImportError`` that names that fix; ``layer.utils.Randomizer``
is there (``utils``)."""

from __future__ import annotations


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"colossalai.shardformer.layer.{name}: meshlab has no hand-sharded "
                      f"layer classes; shard a plain nn.Linear / nn.Embedding by its "
                      f"weight's partition spec instead: meshlab.shard(meshlab.policies.auto, "
                      f"rules) for a Hugging Face model, or meshlab.shard({{'*.weight': "
                      f"P('tp', None)}}) for your own module")
