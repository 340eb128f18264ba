"""remat(..., offload=k) on CUDA: the copies run on a stream of their own, into pinned host
memory and back, and the model trains as it does with the activations kept on the device,
to the device's own repeatability (two runs of the kept layout compared first: where they
agree bit for bit, the offloaded run must too)."""

from __future__ import annotations

import copy

import pytest
import torch

import meshlab as ml
from meshlab.policies import presets

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600), pytest.mark.usefixtures("one_process"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _train(base, spec, steps=3):
    model = ml.parallelize(copy.deepcopy(base), spec, ml.Mesh(dp=1))
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(0, 512, (4, 512), generator=torch.Generator().manual_seed(0)).cuda()
    losses = [ml.step(model, opt, {"input_ids": ids}) for _ in range(steps)]
    return losses, [p.detach().float().clone() for p in model.parameters()]


def _gap(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_trains_as_kept_on_the_device(made):
    cfg = dict(num_hidden_layers=6, hidden_size=512, intermediate_size=1408,
               num_attention_heads=8, num_key_value_heads=4, vocab_size=512)
    base = ml.init_weights(presets.build("tiny-llama", **cfg), seed=0).to("cuda",
                                                                           torch.bfloat16)
    spec = lambda off: ml.fuse() | ml.remat("full", count=2, offload=off)  # noqa: E731
    la, wa = _train(base, spec(0))
    lb, wb = _train(base, spec(0))
    lc, wc = _train(base, spec(3))
    (host,) = made
    assert host.moved > 0 and host.late == 0 and not host.pending
    repeat = _gap(wa, wb)
    assert _gap(wa, wc) <= repeat, (repeat, _gap(wa, wc))
    if repeat == 0:
        assert lc == la
    else:
        assert max(abs(x - y) for x, y in zip(la, lc)) <= max(abs(x - y) for x, y in
                                                              zip(la, lb)) + 1e-6
