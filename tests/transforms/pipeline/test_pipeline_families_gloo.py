"""Pipelines of the families beyond Llama's layout: each trains as one process at pp=2 or
is refused by name, with the fix, before anything runs.

* Gemma (untied): its embeddings are scaled by sqrt(hidden) inside its own forward and its
  norms weigh by 1 + w; pp=2 (1f1b, 4 microbatches) trains as one process in float64
  (losses, gradients and weights of two SGD steps, ``meshlab.verify``). Its RMSNorm
  computes in float32 whatever the dtype (``x.float()``), so the norm weights' gradients,
  summed over four microbatches instead of one batch, round 4e-8 apart; the tolerance is
  float32's (1e-6 relative), where a missed embedding scale or norm offset would move the
  first loss by far more.
* GPT-2 (untied): wte + wpe -> h -> ln_f, learned positions added on the first stage;
  pp=2 (4 microbatches, padded rows) trains as one process in float64 through
  ``meshlab.verify``, alone and with tp=2 beside it.
* The LM head tied to the token embeddings across the first and last stage (Gemma,
  GPT-2): the first stage's rank owns the weight, the last stage's a copy refreshed before
  each schedule, whose gradient joins the owner's. Gemma tied at pp=2 and GPT-2 tied at
  pp=4 (a middle rank outside the pair) and at pp=2 x tp=2 with ZeRO-1 beside, each
  through ``meshlab.verify`` in float64 over two steps.
* Sliding-window attention: each block gets the mask the model's own forward gives it
  (Mistral: every block sliding; Qwen2 with ``use_sliding_window``: per ``layer_types``),
  a window of 4 over 8 positions, pp=2 through ``meshlab.verify`` in float64.
* Refused at plan on a fake mesh (no process group): Cohere's logit scale and Gemma 2's logit soft-capping (transforms of
  the logits the stages do not apply), a GPT-2 sequence classifier (no causal-LM head),
  BERT (laid out as no decoder meshlab stages) and T5 (an encoder-decoder).
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
        "cohere": (lambda: T.CohereForCausalLM(T.CohereConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, logit_scale=0.5)), "logit_scale=0.5"),
        "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=64)), "final_logit_softcapping"),
        "gpt2_classifier": (lambda: T.GPT2ForSequenceClassification(T.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, vocab_size=64, n_positions=64, pad_token_id=0)),
            "has no lm_head"),
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
    spec, mesh = ml.pipeline("pp", microbatches=2), ml.Mesh(pp=2, fake=True)
    with pytest.raises(ml.ConfigError, match="pipeline") as e:
        ml.plan(build(), spec, mesh)
    assert said in str(e.value), str(e.value)


def case_gemma(rank, world, tied: bool = False):
    from tests import _models as M

    data = M.batches(2, batch=8, seq=8, vocab=64)
    report = ml.verify(_gemma(tied), ml.pipeline("pp", microbatches=4), ml.Mesh(pp=2),
                       [{"input_ids": b} for b in data], dtype=torch.float64,
                       atol=1e-9, rtol=1e-6)
    return report.ok, str(report)


def test_gemma_untied_trains_as_one_process(world2):
    for ok, text in world2.run(case_gemma):
        assert ok, text


def _gpt2(tied: bool = False):
    import transformers as T

    cfg = T.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=64, n_positions=64,
                       tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, attn_implementation="sdpa")
    with torch.device("meta"):
        return T.GPT2LMHeadModel(cfg)


def case_gpt2(rank, world, tp: bool, tied: bool = False, pp: int = 2, extra=None):
    from tests import _models as M

    data = M.batches(2, batch=8, seq=8, vocab=64)
    batches = []
    for b in data:
        mask = torch.ones_like(b)
        mask[1, :3] = 0                      # a left-padded row: the mask reaches every stage
        batches.append({"input_ids": b, "attention_mask": mask})
    spec, axes = ml.pipeline("pp", microbatches=4), {"pp": pp}
    if tp:
        spec, axes = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | spec, {**axes, "tp": 2}
    if extra is not None:                    # zero1, zero2, zero3
        spec, axes = spec | ml.zero_shard(int(extra[-1]), "dp"), {**axes, "dp": 2}
    mesh = ml.Mesh(**axes)
    report = ml.verify(_gpt2(tied), spec, mesh, batches, dtype=torch.float64, atol=1e-9,
                       rtol=1e-7)
    return report.ok, str(report)


def test_gpt2_untied_trains_as_one_process(world2):
    for ok, text in world2.run(case_gpt2, tp=False):
        assert ok, text


def test_gpt2_untied_with_tensor_parallelism(world4):
    for ok, text in world4.run(case_gpt2, tp=True):
        assert ok, text


def test_tied_head_across_stages_trains_as_one_process(world2):
    for ok, text in world2.run(case_gemma, tied=True):
        assert ok, text
    for ok, text in world2.run(case_gpt2, tp=False, tied=True):
        assert ok, text


def test_tied_head_across_four_stages_and_beside_tp_and_zero(world4):
    for kw in (dict(pp=4), dict(tp=True), dict(extra="zero1"), dict(extra="zero2"),
               dict(extra="zero3")):
        kw = {"tp": False, **kw}
        for ok, text in world4.run(case_gpt2, tied=True, **kw):
            assert ok, (kw, text)


def case_tied_checkpoint(rank, world, directory, zero: int | None = None):
    """A tied head across the stages resumes exactly from a checkpoint (the copy is not
    saved: it takes the loaded weight before the next schedule), and its Hugging Face
    export loads into one process's model with the head tied as it was."""
    import os

    import transformers as T

    from tests import _models as M

    data = M.batches(3, batch=8, seq=8, vocab=64)
    spec = ml.pipeline("pp", microbatches=4)
    if zero is not None:
        spec = spec | ml.zero_shard(zero, "dp")
    mesh = ml.Mesh(pp=2) if zero is None else ml.Mesh(pp=2, dp=2)

    def build(seed):
        m = ml.parallelize(_gpt2(True).to(torch.float64), spec, mesh, seed=seed)
        return m, ml.optimizer(m, torch.optim.SGD, lr=0.1)

    model, opt = build(0)
    for b in data[:2]:
        ml.step(model, opt, {"input_ids": b})
    path = os.path.join(directory, "tied")
    ml.checkpoint.save(path, model, opt)
    other, other_opt = build(7)
    ml.checkpoint.load(path, other, other_opt)
    want = ml.step(model, opt, {"input_ids": data[2]})
    got = ml.step(other, other_opt, {"input_ids": data[2]})
    same = want == got and all(torch.equal(M.full(a), M.full(b)) for a, b in
                               zip(model.parameters(), other.parameters()))
    export = os.path.join(directory, "hf")
    ml.checkpoint.save_pretrained(export, model)
    whole = T.GPT2LMHeadModel.from_pretrained(export, torch_dtype=torch.float64)
    tied = whole.lm_head.weight is whole.transformer.wte.weight
    mine = {n: M.full(p) for n, p in model.named_parameters()}
    theirs = dict(whole.named_parameters())
    exported = all(torch.equal(mine[n], theirs[n if n in theirs else
                                              "transformer.wte.weight"]) for n in mine)
    return same, tied, exported


def test_tied_head_across_stages_resumes_and_exports(world2, tmp_path):
    for same, tied, exported in world2.run(case_tied_checkpoint, directory=str(tmp_path)):
        assert same and tied and exported, (same, tied, exported)


def _windowed(kind: str):
    import transformers as T

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                  sliding_window=4, attn_implementation="sdpa")
    if kind == "mistral":
        cfg, cls = T.MistralConfig(**common, head_dim=8), T.MistralForCausalLM
    else:
        cfg, cls = T.Qwen2Config(**common, use_sliding_window=True, max_window_layers=2,
                                 tie_word_embeddings=False), T.Qwen2ForCausalLM
    with torch.device("meta"):
        return cls(cfg)


def case_windowed(rank, world, kind):
    from tests import _models as M

    model = _windowed(kind)
    kinds = set(getattr(model.config, "layer_types", None) or ["sliding_attention"])
    data = M.batches(2, batch=8, seq=8, vocab=64)
    report = ml.verify(model, ml.pipeline("pp", microbatches=4), ml.Mesh(pp=2),
                       [{"input_ids": b} for b in data], dtype=torch.float64,
                       atol=1e-9, rtol=1e-7)
    return report.ok, str(report), sorted(kinds)


def test_sliding_window_layers_get_their_masks(world2):
    for kind, want in (("mistral", ["sliding_attention"]),
                       ("qwen2", ["full_attention", "sliding_attention"])):
        for ok, text, kinds in world2.run(case_windowed, kind=kind):
            assert kinds == want, (kind, kinds)
            assert ok, (kind, text)


def case_tied_decode(rank, world):
    """After an optimizer step the last stage's copy of a tied head is behind the
    owner's weight until something reads it: the inference engine brings it up to date
    before it decodes."""
    import torch.distributed as dist

    from meshlab.inference import InferenceConfig, InferenceEngine
    from meshlab.transforms.pipeline._runtime import PipelinePart
    from tests import _models as M

    model = ml.parallelize(M.build("llama", tie_word_embeddings=True, vocab_size=64),
                           ml.pipeline("pp", microbatches=2), ml.Mesh(pp=2), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.5)
    ml.step(model, opt, {"input_ids": M.batches(1, batch=4, seq=8, vocab=64)[0]})
    tied = model._meshlab.part(PipelinePart).tied

    def current() -> bool:
        t = (tied.owner if tied.owner is not None else tied.copy).detach().clone()
        dist.broadcast(t, src=tied.src, group=tied.group)
        return bool(torch.equal(t, tied.copy)) if tied.copy is not None else True

    before = current()
    model.eval()
    engine = InferenceEngine(model, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=1, max_input_len=16, max_output_len=4,
        block_size=4))
    engine.generate(prompts=[[1, 2, 3]], max_new_tokens=2)
    return before, current()


def test_tied_head_copy_is_current_when_decoding(world2):
    out = world2.run(case_tied_decode)
    assert out[1] == (False, True), out        # the last stage's rank: behind, then current


def test_a_forward_the_stages_would_miss_is_refused_at_plan(monkeypatch):
    """The plan runs the model's forward and meshlab's two stages on a tiny float64 copy
    of its config: stages that missed what the forward does (here, as meshlab's did
    before, Mistral's sliding window; or a logit scale not refused by name) are refused
    before anything runs."""
    import importlib

    stage = importlib.import_module("meshlab.transforms.pipeline._stage")
    monkeypatch.setattr(stage, "layer_masks", lambda config: None)
    stage._probe_cached.cache_clear()
    try:
        with pytest.raises(ml.ConfigError, match="stages differ by"):
            ml.plan(_windowed("mistral"), ml.pipeline("pp", microbatches=2),
                    ml.Mesh(pp=2, fake=True))
    finally:
        stage._probe_cached.cache_clear()


def test_tied_head_under_fsdp2_resumes_and_exports(world4, tmp_path):
    for same, tied, exported in world4.run(case_tied_checkpoint, directory=str(tmp_path),
                                           zero=3):
        assert same and tied and exported, (same, tied, exported)
