"""Tiny configs of any Hugging Face family, and the model and batch to train one.

The family walk (``walk``) builds every family whose config carries a
``base_model_tp_plan`` at a few thousand parameters: the default config's size fields
are shrunk (only the fields the family's config has), per-layer lists cut to the layer
count, and the model built with the class ``auto_class`` picks (causal LM, seq2seq,
image classification, masked LM, the base model, else the config's own model class).
"""

from __future__ import annotations

import torch

from ..policies.models import auto_class, from_config
from ..policies.tiny import (LAYERS as LAYERS, VOCAB as VOCAB,
                             TinyConfigError as TinyConfigError, tiny_config as tiny_config)

MAX_PARAMS = 20_000_000
_NON_TEXT = ("vision", "encoder", "image", "audio")


# (name in transformers' modeling_auto, auto class), tried in this order; an
# encoder-decoder config tries the two seq2seq classes first, so that T5, BART or Whisper
# is built whole (encoder and decoder), not as the decoder alone that their causal-LM
# class is
def build(model_type: str):
    """The tiny model on the meta device, eager attention."""
    if any(w in model_type for w in _NON_TEXT):
        raise TinyConfigError(f"{model_type} takes non-text inputs; the walk feeds token ids")
    cfg = tiny_config(model_type)
    cfg._attn_implementation = "eager"
    # the experts' loop of matmuls, not torch's grouped_mm (which takes no float64)
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    cls = auto_class(cfg)
    try:
        with torch.device("meta"):
            model = from_config(cls, cfg)
    except Exception as e:
        raise TinyConfigError(f"tiny model not built: {type(e).__name__}: {e}") from None
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise TinyConfigError(f"the tiny config of {model_type} still has {n:,} parameters "
                              f"(a size field the walk does not know)")
    return model


def batch(seed: int = 1, size: int = 2, seq: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, seq), generator=g)


def loss(model, out, ids):
    """The causal-LM loss on logits, else the mean square of the last hidden state."""
    from ..transforms import losses

    logits = getattr(out, "logits", None)
    if logits is not None:
        return losses.causal_lm_loss(out, {"input_ids": ids})
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h.float().pow(2).mean()
