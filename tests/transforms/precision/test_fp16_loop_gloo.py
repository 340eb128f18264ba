"""``precision('fp16')`` in a training loop of your own (gloo, world 2).

``meshlab.optimizer``'s step divides the gradients by the loss scale; ``ml.step`` and the
Booster multiply the loss by it before the backward, a plain ``loss.backward()`` did not:
every update of that loop was the true one divided by the scale (2**16), with no error,
and the scale grew on as no step overflowed. Now the step refuses a backward that did
not run on the scaled loss, naming the fix, and ``opt.scale(loss).backward()`` (torch's
``GradScaler.scale``) trains as ``ml.step`` does.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(300)


def loop_case(rank, world, how):
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), ml.precision("fp16") | ml.data_parallel("dp"),
                           ml.Mesh(dp=world), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = M.batches(1, batch=4)[0].chunk(world)[rank]
    try:
        if how == "step":
            ml.step(model, opt, {"input_ids": x})
        else:
            loss = model(input_ids=x, labels=x).loss
            (opt.scale(loss) if how == "scaled" else loss).backward()
            opt.step()
            opt.zero_grad()
    except ml.MeshlabError as e:
        moved = any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
        return type(e).__name__, str(e), moved
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def test_an_unscaled_backward_is_refused(world2):
    for kind, msg, moved in world2.run(loop_case, how="plain"):
        assert kind == "ConfigError" and "opt.scale(loss).backward()" in msg, (kind, msg)
        assert not moved


def test_a_scaled_backward_trains_as_step(world2):
    for got, want in zip(world2.run(loop_case, how="scaled"), world2.run(loop_case, how="step")):
        assert max(float(d.abs().max()) for d in want.values()) > 1e-4
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-9)
