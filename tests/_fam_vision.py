"""Vision families of the parity harness (``_families``): tiny configs and batches.

``vit`` is an image classifier (17 tokens: 16 patches and the CLS token); ``vit_sp`` the
same model at 12 px (9 patches and CLS: 10 tokens, which split over tp=2 under sequence
parallelism). ``sam`` is SamModel prompted with points, a box and a mask, trained to
random mask and IoU targets; its weights are drawn at std 0.1 (the default std, 1e-10 in
the image encoder, gives masks of 1e-6, whose loss no tolerance could tell apart; at 0.2
the keys' biases, whose true gradient is zero, get rounding noise near AdamW's eps,
which Adam amplifies). ``blip-2`` is Blip2ForConditionalGeneration with an OPT language
model, its prompt starting with one image token per query token, the query tokens drawn
at random (``post_init``).
"""

from __future__ import annotations

import torch

import meshlab as ml

from ._families import Family

_VIT = dict(model_type="vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, image_size=16, patch_size=4, num_channels=3, num_labels=5,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _images(size: int):
    def batch(n, g):
        return {"pixel_values": torch.randn(n, 3, size, size, generator=g),
                "labels": torch.randint(0, 5, (n,), generator=g)}
    return batch


def _classify(out, batch):
    return torch.nn.functional.cross_entropy(out.logits, batch["labels"])


_SAM = dict(
    model_type="sam",
    vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2,
                       num_attention_heads=4, image_size=32, patch_size=4, mlp_dim=64,
                       window_size=4, global_attn_indexes=[1], num_pos_feats=8,
                       initializer_range=0.1),
    prompt_encoder_config=dict(hidden_size=16, image_size=32, patch_size=4,
                               image_embedding_size=8, mask_input_channels=8),
    mask_decoder_config=dict(hidden_size=16, mlp_dim=32, num_hidden_layers=2,
                             num_attention_heads=4, iou_head_hidden_dim=16),
    initializer_range=0.1)


def _sam_batch(n, g):
    """Two points (labels 1, 0 or -1), one box and a mask prompt per image, and random
    targets for the masks and IoU scores."""
    return {"pixel_values": torch.randn(n, 3, 32, 32, generator=g),
            "input_points": torch.rand(n, 1, 2, 2, generator=g) * 32,
            "input_labels": torch.randint(-1, 2, (n, 1, 2), generator=g),
            "input_boxes": torch.rand(n, 1, 4, generator=g) * 32,
            "input_masks": torch.randn(n, 1, 32, 32, generator=g),
            "target_masks": torch.randn(n, 1, 3, 32, 32, generator=g),
            "target_iou": torch.rand(n, 1, 3, generator=g)}


def _sam_loss(out, batch):
    mse = torch.nn.functional.mse_loss
    return mse(out.pred_masks, batch["target_masks"]) + mse(out.iou_scores, batch["target_iou"])


_IMAGE_TOKEN, _QUERIES = 96, 4
_BLIP2 = dict(
    model_type="blip-2", num_query_tokens=_QUERIES, image_token_id=_IMAGE_TOKEN,
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, image_size=16, patch_size=4,
                       initializer_range=0.02),
    qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, encoder_hidden_size=32,
                        cross_attention_frequency=1, vocab_size=97,
                        max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0),
    text_config=dict(model_type="opt", hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=97, max_position_embeddings=64,
                     word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                     pad_token_id=1, bos_token_id=2, eos_token_id=2))


def _blip2_batch(n, g):
    """One image token per query token, then 8 text tokens; the labels ignore the
    image positions."""
    text = torch.randint(3, _IMAGE_TOKEN, (n, 8), generator=g)
    ids = torch.cat([torch.full((n, _QUERIES), _IMAGE_TOKEN), text], dim=1)
    labels = ids.masked_fill(ids == _IMAGE_TOKEN, -100)
    return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g), "input_ids": ids,
            "labels": labels}


def _blip2_queries(model):
    """Blip2 initializes its query tokens to zeros: every query is the same and the
    Q-Former's layernorms see zero variance. Seeded random queries instead."""
    g = torch.Generator().manual_seed(0)
    model.query_tokens.copy_(torch.randn(model.query_tokens.shape, generator=g))


def _lm(out, batch):
    return ml.losses.causal_lm_loss(out, batch)


FAMILIES = {
    "vit": Family(_VIT, "AutoModelForImageClassification", _images(16), _classify,
                  inputs=("pixel_values",)),
    "vit_sp": Family({**_VIT, "image_size": 12}, "AutoModelForImageClassification",
                     _images(12), _classify, inputs=("pixel_values",)),
    "sam": Family(_SAM, "AutoModel", _sam_batch, _sam_loss,
                  inputs=("pixel_values", "input_points", "input_labels", "input_boxes",
                          "input_masks")),
    "blip-2": Family(_BLIP2, "AutoModelForImageTextToText", _blip2_batch, _lm,
                     inputs=("pixel_values", "input_ids"), post_init=_blip2_queries),
}
