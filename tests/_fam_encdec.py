"""Encoder-decoder families of the parity harness (``_families``): tiny configs and batches.

``t5`` is T5ForConditionalGeneration (relative position bias, cross-attention, the shared
embedding tied to both stacks and the LM head); ``t5_gated`` the same with T5 v1.1's
gated feed-forward (wi_0, wi_1) and an untied head; ``whisper`` is
WhisperForConditionalGeneration on 8 mel bins of 32 frames (16 encoder positions). The
loss is the token cross-entropy of the logits against the labels, which are aligned with
the decoder inputs (no shift), read from vocabulary-split logits.
"""

from __future__ import annotations

import torch

import meshlab as ml

from ._families import Family

V = 97
SRC, TGT = 8, 6       # encoder and decoder lengths (Whisper's source: 32 frames)


def _seq2seq(out, batch):
    return ml.losses.masked_lm_loss(out, batch)


def _text(n, g):
    return {"input_ids": torch.randint(0, V, (n, SRC), generator=g),
            "decoder_input_ids": torch.randint(0, V, (n, TGT), generator=g),
            "labels": torch.randint(0, V, (n, TGT), generator=g)}


def _audio(n, g):
    return {"input_features": torch.randn(n, 8, 32, generator=g),
            "decoder_input_ids": torch.randint(0, V, (n, TGT), generator=g),
            "labels": torch.randint(0, V, (n, TGT), generator=g)}


_T5 = dict(model_type="t5", d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2,
           num_heads=4, d_kv=8, vocab_size=V, dropout_rate=0.0, decoder_start_token_id=0)

FAMILIES = {
    "t5": Family(_T5, "AutoModelForSeq2SeqLM", _text, _seq2seq,
                 inputs=("input_ids", "decoder_input_ids")),
    "t5_gated": Family(dict(_T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
                       "AutoModelForSeq2SeqLM", _text, _seq2seq,
                       inputs=("input_ids", "decoder_input_ids")),
    "whisper": Family(dict(model_type="whisper", d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V,
                           num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                           pad_token_id=1, bos_token_id=2, eos_token_id=2,
                           decoder_start_token_id=3),
                      "AutoModelForSpeechSeq2Seq", _audio, _seq2seq,
                      inputs=("input_features", "decoder_input_ids")),
}
