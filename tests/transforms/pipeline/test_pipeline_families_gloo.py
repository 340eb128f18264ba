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
* Sequence classifiers (GPT-2's and Llama's ``*ForSequenceClassification``): the last
  stage runs the ``score`` head and pools each row at its last token that is not padding,
  reading the microbatch's input ids as the model's forward does; rows padded at their
  end, pp=2 (and GPT-2 at dp=2 x pp=2) through ``meshlab.verify`` in float64 with a
  cross-entropy of the pooled logits. Without a pad id, microbatches of more than one
  row are refused on every rank, as the model's forward refuses such batches.
* ``pipeline(microbatch_size=...)``: each batch cut into microbatches of that many rows
  as it comes, as one process trains; a batch it does not divide, or too short for one
  microbatch per stage, refused on every rank.
* Refused at plan on a fake mesh (no process group): Cohere's logit scale and Gemma 2's
  logit soft-capping (transforms of the logits the stages do not apply), a GPT-2 token
  classifier (neither a causal-LM head nor a pooled one), BERT (laid out as no decoder
  meshlab stages) and T5 (an encoder-decoder).
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
        "gpt2_token_classifier": (lambda: T.GPT2ForTokenClassification(T.GPT2Config(
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


def _classifier(family: str, pad: int | None = 0):
    import transformers as T

    if family == "gpt2":
        cfg = T.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=64, n_positions=64,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           attn_implementation="sdpa", num_labels=3, pad_token_id=pad)
        cls = T.GPT2ForSequenceClassification
    else:
        cfg = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                            attn_implementation="sdpa", num_labels=3, pad_token_id=pad)
        cls = T.LlamaForSequenceClassification
    with torch.device("meta"):
        return cls(cfg)


def _pooled_loss(out, batch):
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits, batch["labels"])


def _labelled_batches(pad: int = 0):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        ids = torch.randint(1, 64, (8, 8), generator=g)
        ids[1, -3:] = pad                     # rows that end in padding: pooled earlier
        ids[6, -1:] = pad
        out.append({"input_ids": ids, "attention_mask": (ids != pad).long(),
                    "labels": torch.randint(0, 3, (8,), generator=g)})
    return out


def case_classifier(rank, world, family: str, dp: int = 1):
    spec, axes = ml.pipeline("pp", microbatches=2), {"pp": 2}
    if dp > 1:
        spec, axes = ml.data_parallel("dp") | spec, {"dp": dp, **axes}
    report = ml.verify(_classifier(family), spec, ml.Mesh(**axes), _labelled_batches(),
                       loss_fn=_pooled_loss, dtype=torch.float64, atol=1e-9, rtol=1e-7)
    return report.ok, str(report)


def case_classifier_without_pad(rank, world):
    model = ml.parallelize(_classifier("gpt2", pad=None), ml.pipeline("pp", microbatches=2),
                           ml.Mesh(pp=2), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    batch = {k: v for k, v in _labelled_batches()[0].items() if k != "attention_mask"}
    try:
        ml.step(model, opt, batch, loss_fn=_pooled_loss)
    except ml.ConfigError as e:          # on every rank, before the schedule's first send
        return str(e)
    return None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sequence_classifier_pools_on_the_last_stage(world2, family):
    for ok, text in world2.run(case_classifier, family=family):
        assert ok, text


def test_sequence_classifier_beside_data_parallelism(world4):
    for ok, text in world4.run(case_classifier, family="gpt2", dp=2):
        assert ok, text


def test_sequence_classifier_without_a_pad_id_is_refused_on_every_rank(world2):
    for said in world2.run(case_classifier_without_pad):
        assert said is not None and "names no pad_token_id" in said, said


def case_microbatch_size(rank, world):
    """``pipeline(microbatch_size=2)``: each batch of 8 rows runs as 4 microbatches
    (Colossal-AI's ``microbatch_size``), as one process trains; a batch its size does not
    divide, or one of fewer microbatches than stages, is refused on every rank."""
    spec = ml.pipeline("pp", microbatch_size=2)
    report = ml.verify(_classifier("gpt2"), spec, ml.Mesh(pp=2), _labelled_batches(),
                       loss_fn=_pooled_loss, dtype=torch.float64, atol=1e-9, rtol=1e-7)
    model = ml.parallelize(_classifier("llama"), ml.pipeline("pp", microbatch_size=4),
                           ml.Mesh(pp=2), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    said = []
    for rows in (6, 4):
        batch = {k: v[:rows] for k, v in _labelled_batches()[0].items()}
        try:
            ml.step(model, opt, batch, loss_fn=_pooled_loss)
            said.append(None)
        except ml.ConfigError as e:
            said.append(str(e))
    return report.ok, str(report), said


def test_microbatch_size_cuts_each_batch_as_it_comes(world2):
    for ok, text, said in world2.run(case_microbatch_size):
        assert ok, text
        assert all(s is not None and "microbatch_size=4" in s for s in said), said
        assert "6 rows" in said[0] and "at least 8" in said[1], said


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
