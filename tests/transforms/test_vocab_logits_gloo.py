"""A user's own loss on the logits of a vocabulary-parallel head (2 gloo processes).

``model(ids).logits`` of ``shard(policies.auto, Rules(vocab='tp', ...))`` at tp=2 is a
DTensor split over the vocabulary. ``F.cross_entropy`` on it with plain labels failed
inside DTensor's dispatch ("got mixed torch.Tensor and DTensor"); it is a ``ConfigError``
naming meshlab's loss for split logits, raised on every rank before any collective, and
the fixes it names give the loss of the whole logits."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(300)


def user_loss_case(rank, world):
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    import meshlab as ml
    from meshlab.estimate.comm import CommCounter

    model = ml.parallelize(M.build("llama"), ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)),
                           ml.Mesh(dp=1, tp=world), seed=0)
    x = M.batches(1)[0]
    logits = model(x).logits
    assert isinstance(logits, DTensor) and logits.placements[0].is_shard(2)
    flat, y = logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()
    refused, comms = [], []
    for call in (lambda: F.cross_entropy(flat, y),
                 lambda: torch.nn.CrossEntropyLoss()(flat, y),
                 lambda: F.nll_loss(F.log_softmax(flat, -1), y),   # the gather is the user's
                 lambda: logits.argmax(-1) == x):
        with CommCounter() as cc:
            try:
                call()
                refused.append(None)
            except ml.ConfigError as e:
                refused.append(str(e))
        comms.append(len(cc.calls))
    ours = ml.losses.cross_entropy(logits[:, :-1], x[:, 1:])
    whole = F.cross_entropy(logits.full_tensor()[:, :-1].flatten(0, 1), y)
    ours.backward()
    return refused, comms, float(ours), float(whole)


def test_a_users_cross_entropy_on_split_logits_names_the_fix(world2):
    for refused, comms, ours, whole in world2.run(user_loss_case):
        assert comms[:2] == [0, 0], comms          # refused before any collective
        assert all(r is not None for r in refused), refused
        assert all("meshlab.losses.cross_entropy" in r and "full_tensor()" in r for r in refused)
        assert "split over the vocabulary" in refused[0] and "labels a plain tensor" in refused[0]
        assert ours == pytest.approx(whole, rel=1e-6)


def loss_first_case(rank, world):
    """``model(input_ids=x, labels=x)`` of a vocabulary-parallel head: meshlab computes the
    loss and sets it on the output, which must hold it first, as transformers' own does
    (``out[0]``, ``out.to_tuple()[0]``: what Colossal-AI's scripts backward)."""
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)),
                           ml.Mesh(dp=1, tp=world), seed=0)
    ref = ml.init_weights(M.build("llama"), seed=0)
    x = M.batches(1)[0]
    # a parallelized model's training forward builds no KV cache (transformers' builds one
    # unless told): the reference is told, so both outputs hold the same keys
    out, want = model(input_ids=x, labels=x), ref(input_ids=x, labels=x, use_cache=False)
    return (list(out.keys()), list(want.keys()), out[0] is out.loss,
            out.to_tuple()[0] is out.loss, float(out.loss), float(want.loss))


def test_the_loss_of_a_split_head_comes_first_in_the_output(world2):
    for keys, want_keys, first, first_of_tuple, loss, want in world2.run(loss_first_case):
        assert keys == want_keys and keys[0] == "loss", (keys, want_keys)
        assert first and first_of_tuple
        assert loss == pytest.approx(want, rel=1e-5)
