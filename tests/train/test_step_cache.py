"""A training forward builds no KV cache: a Hugging Face model's ``config.use_cache``
defaults to True, and its forward would then copy every layer's keys and values into a
``DynamicCache`` and hold them until the loss (and, under compiled blocks, guard each
block's graph on the cache's state). A parallelized model's forward in training mode, with
gradients on, runs with ``use_cache=False`` unless the call passes ``use_cache`` or
``past_key_values``, through ``meshlab.step`` and through a plain loop alike; the loss is
the same, and an evaluation keeps the model's behaviour."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(300)


def _cached_layers(monkeypatch) -> list:
    from transformers import cache_utils

    calls = []
    update = cache_utils.DynamicLayer.update

    def counted(self, *args, **kwargs):
        calls.append(1)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicLayer, "update", counted)
    return calls


def _model(spec: str):
    import meshlab as ml

    model = M.build("llama")
    assert model.config.use_cache          # transformers' default
    return ml.parallelize(model, ml.fuse() if spec == "fuse" else ml.data_parallel("dp"),
                          ml.Mesh(dp=1), seed=0)


@pytest.mark.parametrize("spec", ["fuse", "plain"])
def test_a_training_step_builds_no_kv_cache(one_process, monkeypatch, spec):
    import meshlab as ml

    calls = _cached_layers(monkeypatch)
    losses = {}
    ids = M.batches(1, batch=2, seq=8)[0]
    for say in (None, True):
        model = _model(spec)
        opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
        batch = {"input_ids": ids} if say is None else {"input_ids": ids, "use_cache": say}
        calls.clear()
        losses[say] = ml.step(model, opt, batch)
        # no cache unless the batch asks for one (then one update per layer)
        assert len(calls) == (0 if say is None else model.config.num_hidden_layers), calls
    assert losses[None] == losses[True]


def test_a_plain_training_loop_builds_no_kv_cache_and_evaluation_keeps_it(one_process,
                                                                          monkeypatch):
    calls = _cached_layers(monkeypatch)
    model = _model("plain")
    layers = model.config.num_hidden_layers
    ids = M.batches(1, batch=2, seq=8)[0]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert calls == [] and out.past_key_values is None
    # asked for by the call: built
    out = model(input_ids=ids, labels=ids, use_cache=True)
    assert len(calls) == layers and out.past_key_values is not None
    calls.clear()
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids)
    assert len(calls) == layers and out.past_key_values is not None
