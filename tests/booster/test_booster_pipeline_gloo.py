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
