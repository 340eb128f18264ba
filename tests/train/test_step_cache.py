"""A training step builds no KV cache: a Hugging Face model's ``config.use_cache`` defaults
to True, and its forward would then copy every layer's keys and values into a
``DynamicCache`` and hold them until the loss (and, under compiled blocks, guard each
block's graph on the cache's state). ``meshlab.step`` calls a forward that takes
``use_cache`` with ``use_cache=False`` unless the batch says; the loss is the same."""

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


@pytest.mark.parametrize("spec", ["fuse", "plain"])
def test_a_training_step_builds_no_kv_cache(one_process, monkeypatch, spec):
    import meshlab as ml

    calls = _cached_layers(monkeypatch)
    losses = {}
    for say in (None, True):
        model = M.build("llama")
        assert model.config.use_cache          # transformers' default
        model = ml.parallelize(model, ml.fuse() if spec == "fuse" else ml.data_parallel("dp"),
                               ml.Mesh(dp=1), seed=0)
        opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
        ids = M.batches(1, batch=2, seq=8)[0]
        batch = {"input_ids": ids} if say is None else {"input_ids": ids, "use_cache": say}
        calls.clear()
        losses[say] = ml.step(model, opt, batch)
        # no cache unless the batch asks for one (then one update per layer)
        assert len(calls) == (0 if say is None else model.config.num_hidden_layers), calls
    assert losses[None] == losses[True]
