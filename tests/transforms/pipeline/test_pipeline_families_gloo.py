"""Pipelines of the families beyond Llama's layout: each trains as one process at pp=2 or
is refused by name, with the fix, before anything runs.

* Gemma (untied): its embeddings are scaled by sqrt(hidden) inside its own forward and its
  norms weigh by 1 + w; pp=2 (1f1b, 4 microbatches) trains as one process in float64
  (losses, gradients and weights of two SGD steps, ``meshlab.verify``). Its RMSNorm
  computes in float32 whatever the dtype (``x.float()``), so the norm weights' gradients,
  summed over four microbatches instead of one batch, round 4e-8 apart; the tolerance is
  float32's (1e-6 relative), where a missed embedding scale or norm offset would move the
  first loss by far more.
* Refused at plan on a fake mesh (no process group): Gemma with its head tied to the
  embeddings (tied weights across the first and last stage), GPT-2 and BERT (not laid out
  as embed_tokens -> layers -> norm) and T5 (an encoder-decoder).
"""

from __future__ import annotations

import pytest
import torch

import meshlab as ml

pytestmark = pytest.mark.timeout(600)


def _gemma(tied: bool):
    import transformers as T

    cfg = T.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=64, tie_word_embeddings=tied, attn_implementation="sdpa")
    with torch.device("meta"):
        return T.GemmaForCausalLM(cfg)


def _refused():
    import transformers as T

    return {
        "gemma_tied": (lambda: _gemma(True), "tie_word_embeddings=False"),
        "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, vocab_size=64, n_positions=64)),
            "embed_tokens -> layers -> norm"),
        "bert": (lambda: T.BertForMaskedLM(T.BertConfig(
            hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
            vocab_size=64)), "embed_tokens -> layers -> norm"),
        "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
            d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8,
            vocab_size=64)), "encoder-decoder"),
    }


@pytest.mark.parametrize("family", sorted(_refused()))
def test_refused_by_name_at_plan(family):
    build, said = _refused()[family]
    with pytest.raises(ml.ConfigError, match="pipeline") as e:
        ml.plan(build(), ml.pipeline("pp", microbatches=2), ml.Mesh(pp=2, fake=True))
    assert said in str(e.value), str(e.value)


def case_gemma(rank, world):
    from tests import _models as M

    data = M.batches(2, batch=8, seq=8, vocab=64)
    report = ml.verify(_gemma(False), ml.pipeline("pp", microbatches=4), ml.Mesh(pp=2),
                       [{"input_ids": b} for b in data], dtype=torch.float64,
                       atol=1e-9, rtol=1e-6)
    return report.ok, str(report)


def test_gemma_untied_trains_as_one_process(world2):
    for ok, text in world2.run(case_gemma):
        assert ok, text
