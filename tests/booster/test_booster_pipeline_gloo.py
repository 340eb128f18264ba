"""``Booster.execute_pipeline`` on 2 gloo ranks (pp=2): without an optimizer it runs the
schedule's forward only, as one process evaluates (the loss, the last stage's logits, no
gradient); the criterion runs on the last stage with every key of the microbatch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests import REPO

pytestmark = pytest.mark.timeout(900)
ROOT = os.fspath(REPO)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def forward_only_case(rank, world, dtype=torch.float32):
    from examples import booster_loop as L
    from meshlab.booster import Booster, HybridParallelPlugin

    L.colossalai.launch_from_torch(seed=42, verbose=False)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32",
                                                  num_microbatches=2))
    model = L.make_model("ddp").to(dtype)
    opt = L.HybridAdam(model.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(model, opt)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, L.VOCAB, (4, 16), generator=g)
    labels = x.clone()
    labels[:, -3:] = -100
    seen = []

    def criterion(outputs, inputs):
        seen.append(sorted(inputs))
        # transformers' own loss is float32 for any model: a float64 one is taken here
        return _ce(outputs.logits, inputs["labels"]) if dtype == torch.float64 \
            else outputs.loss

    got = booster.execute_pipeline(iter([{"input_ids": x, "labels": labels}]), model,
                                   criterion, None, return_outputs=True)
    assert all(p.grad is None for p in model.parameters())
    torch.manual_seed(42)
    ref = L.make_model("ddp").to(dtype)
    with torch.no_grad():
        want = sum(criterion(ref(input_ids=x[i:i + 2], labels=labels[i:i + 2]),
                             {"labels": labels[i:i + 2]}) for i in (0, 2)) / 2
        logits = ref(input_ids=x).logits
    if dtype == torch.float64:      # every digit: the loss was a float32 tensor before
        assert abs(float(got["loss"]) - float(want)) < 1e-13, (float(got["loss"]), float(want))
    torch.testing.assert_close(got["loss"].to(dtype), want, rtol=1e-5, atol=1e-6)
    if got["outputs"] is not None:          # the model's own output, as Colossal-AI's
        torch.testing.assert_close(got["outputs"]["logits"], logits, rtol=1e-4, atol=1e-5)
        if dtype == torch.float64:
            torch.testing.assert_close(got["outputs"]["logits"], logits, rtol=0, atol=1e-12)
        assert got["outputs"].logits is got["outputs"]["logits"]
    return got["outputs"] is not None, seen[:2]


def _ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             labels[:, 1:].flatten(), ignore_index=-100)


def test_execute_pipeline_without_optimizer_is_forward_only(world2):
    out = world2.run(forward_only_case)
    assert sorted(o[0] for o in out) == [False, True]       # the last stage has the logits
    last = next(o for o in out if o[0])
    assert last[1] == [["input_ids", "labels"]] * 2            # each microbatch, every key


def test_execute_pipeline_keeps_a_float64_models_loss(world2):
    out = world2.run(forward_only_case, dtype=torch.float64)
    assert sorted(o[0] for o in out) == [False, True]


def two_models_case(rank, world):
    """One criterion for two boosted pipelines of different vocabularies: each runs its
    own model's loss (the adapter was cached by the criterion alone, and the second model
    ran the first's: an untyped error on the vocabulary's size). A fresh criterion each
    call keeps only the latest schedules. Calling a pipelined model by hand says how it
    runs, on every rank (an untyped TypeError before)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples import booster_loop as L
    from meshlab import ConfigError
    from meshlab.booster import Booster, HybridParallelPlugin
    from meshlab.transforms._install import runtime_of
    from meshlab.transforms.pipeline._runtime import KEPT_SCHEDULES, PipelinePart

    L.colossalai.launch_from_torch(seed=42, verbose=False)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32",
                                                  num_microbatches=2))
    got, want = [], []
    criterion = lambda outputs, inputs: outputs.loss      # noqa: E731
    for vocab in (L.VOCAB, L.VOCAB + 31):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(cfg)
        ref = LlamaForCausalLM(cfg)
        ref.load_state_dict(model.state_dict())
        model, *_ = booster.boost(model)
        x = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(vocab))
        batch = {"input_ids": x, "labels": x}
        got.append(float(booster.execute_pipeline(iter([batch]), model, criterion)["loss"]))
        with torch.no_grad():
            want.append(float(sum(ref(input_ids=x[i:i + 2], labels=x[i:i + 2]).loss
                                  for i in (0, 2)) / 2))
    for _ in range(KEPT_SCHEDULES + 3):
        booster.execute_pipeline(iter([batch]), model, lambda o, i: o.loss)
    part = runtime_of(model).part(PipelinePart)
    with pytest.raises(ConfigError, match="not an iterator; pass iter"):
        booster.execute_pipeline([batch], model, criterion)
    with pytest.raises(ConfigError, match=r"booster.execute_pipeline\(...\), not model"):
        model(input_ids=x)
    return got, want, len(part._schedules)


def test_one_criterion_for_two_pipelined_models(world2):
    for got, want, kept in world2.run(two_models_case):
        assert abs(got[0] - want[0]) < 1e-5 and abs(got[1] - want[1]) < 1e-5, (got, want)
        assert kept <= 4, kept
