"""BLIP-2: a ViT image encoder, a Q-Former (BERT-like layers whose learned queries
attend to themselves and, by cross-attention, to the image), a linear projection into
the language model's embedding space, and an OPT language model.

Image encoder: each layer's MLP (``fc1``/``fc2``) is a tensor-parallel region; its
attention stays replicated on purpose. ``Blip2Attention`` reshapes the packed ``qkv``
output to (batch, seq, 3, heads, embed_dim // heads) with ``embed_dim`` read from its
*input*, the whole hidden size: with this rank's heads the head width comes out wrong
(the local width holds heads x head_dim, not embed_dim), so no setting of its
attributes runs it on a local shard. It runs whole, on the whole activations, outside
every region, so its gradients are whole.

Q-Former: self-attention (query/key/value over heads, ``attention.output.dense``
joining them), cross-attention (its key and value read the image features, not the
region's hidden states: each is a region of its own, so that input enters too) and the
query MLP (``intermediate_query``/``output_query``) are regions; its layernorms, the
query tokens and ``language_projection`` stay replicated outside them.

Language model: the ``opt`` policy, rooted at ``language_model``: vocab-parallel
embedding and head (the logits stay vocab-sharded; ``meshlab.transforms.losses`` reads them). A
BLIP-2 whose text config is not OPT (Flan-T5) does not fit: the OPT globs match no module
and ``policies.auto`` raises PolicyError naming them.

Sequence parallelism does not apply (three stacks of blocks: image encoder, Q-Former,
language model); the layout check refuses it (ConfigError).
"""

from __future__ import annotations

import dataclasses

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register
from .opt import OPT

_VIS = "vision_model.encoder.layers.*"
_Q = "qformer.encoder.layer.*"
_CROSS = f"{_Q}.crossattention.attention"
_ROWS = P("batch", "seq", "embed")


def _rooted(policy: Policy, root: str, base: str) -> Policy:
    """``policy`` (globs relative to its model's base ``base``, or its root for ``/...``)
    as a part of a model that holds that model at ``root``: every glob root-relative."""
    def glob(g: str) -> str:
        return f"/{root}{g[1:]}" if g.startswith("/") else f"/{root}{base}{g}"

    def item(x):
        if isinstance(x, str):
            return glob(x)
        if isinstance(x, R):
            return dataclasses.replace(x, glob=glob(x.glob))
        return (glob(x[0]),) + tuple(x[1:])    # (glob, spec / attribute / ...)

    return dataclasses.replace(policy, **{
        f.name: tuple(item(x) for x in getattr(policy, f.name))
        for f in dataclasses.fields(policy) if f.name != "name"})


_QFORMER = Policy(
    name="blip-2",
    modules=(
        R("vision_model.embeddings.patch_embedding", "replicate"),
        R(f"{_VIS}.self_attn.qkv", "replicate"),
        R(f"{_VIS}.self_attn.projection", "replicate"),
        R(f"{_VIS}.mlp.fc1", "colwise", axis="mlp"),
        R(f"{_VIS}.mlp.fc2", "rowwise", axis="mlp"),
        R(f"{_VIS}.layer_norm1", "norm"), R(f"{_VIS}.layer_norm2", "norm"),
        R("vision_model.post_layernorm", "norm"),
        *(R(f"{_Q}.{a}.attention.{p}", "colwise", axis="heads")
          for a in ("attention", "crossattention") for p in ("query", "key", "value")),
        R(f"{_Q}.attention.output.dense", "rowwise", axis="heads"),
        R(f"{_Q}.crossattention.output.dense", "rowwise", axis="heads"),
        R(f"{_Q}.intermediate_query.dense", "colwise", axis="mlp"),
        R(f"{_Q}.output_query.dense", "rowwise", axis="mlp"),
        R(f"{_Q}.intermediate.dense", "colwise", axis="mlp"),     # use_qformer_text_input
        R(f"{_Q}.output.dense", "rowwise", axis="mlp"),
        R(f"{_Q}.attention.output.LayerNorm", "norm"),
        R(f"{_Q}.crossattention.output.LayerNorm", "norm"),
        R(f"{_Q}.output_query.LayerNorm", "norm"),
        R("qformer.layernorm", "norm"),
        R("language_projection", "replicate"),
    ),
    # The Q-Former's attention modules are the model's repeated blocks (the most
    # numerous of its no-split modules): their output spec is what marks a
    # sequence-parallel run, which the layout refuses for these three stacks.
    activations=((_VIS, _ROWS), (_Q, _ROWS), (f"{_Q}.attention.attention", _ROWS),
                 (_CROSS, _ROWS)),
    regions=(f"{_VIS}.mlp", f"{_Q}.attention.attention", _CROSS, f"{_CROSS}.key",
             f"{_CROSS}.value", f"{_Q}.intermediate_query", f"{_Q}.intermediate"),
    local_attrs=tuple((f"{_Q}.{a}.attention", attr) for a in ("attention", "crossattention")
                      for attr in ("num_attention_heads", "all_head_size")),
    optional=(f"{_Q}.intermediate.dense", f"{_Q}.output.dense", f"{_Q}.intermediate"),
)

BLIP_2 = register("blip-2", _rooted(OPT, "language_model.", "model.") + _QFORMER)
