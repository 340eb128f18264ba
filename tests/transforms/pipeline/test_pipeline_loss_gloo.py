"""A pipelined Hugging Face decoder computes the caller's loss on the last stage over the
microbatch as the batch holds it (``input_ids`` and ``labels`` each its own), and
evaluates with the schedule's forward only (``step(..., train=False)``), both as one
process does (float64, SGD)."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(900)
LAYERS = dict(num_hidden_layers=4)
MICRO = 4


def even_token_loss(out, batch):
    """Next-token cross-entropy against ``labels`` at the positions whose input id is even
    (a loss that reads both keys, which differ)."""
    logits = getattr(out, "logits", out)
    labels = batch["labels"][:, 1:]
    keep = (batch["input_ids"][:, :-1] % 2 == 0) & (labels != -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             labels.masked_fill(~keep, -100).flatten())


def _batches(steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 97, (8, 8), generator=g)
        labels = torch.randint(0, 97, (8, 8), generator=g)
        labels[:, -2:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _mean(ref, batch) -> torch.Tensor:
    mbs = [{k: v.chunk(MICRO)[i] for k, v in batch.items()} for i in range(MICRO)]
    return sum(even_token_loss(ref(input_ids=mb["input_ids"]), mb) for mb in mbs) / MICRO


def loss_case(rank, world, schedule, steps=3, lr=0.5):
    import meshlab as ml

    torch.set_default_dtype(torch.float64)
    try:
        data = _batches(steps + 1)
        model = ml.parallelize(M.build("llama", **LAYERS),
                               ml.pipeline("pp", schedule=schedule, microbatches=MICRO),
                               ml.Mesh(pp=world), seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = [ml.step(model, opt, b, even_token_loss) for b in data[:steps]]
        evaluated = ml.step(model, None, data[-1], even_token_loss, train=False)
        assert all(p.grad is None for p in model.parameters())
        ref = ml.init_weights(M.build("llama", **LAYERS), seed=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
        want = []
        for b in data[:steps]:
            loss = _mean(ref, b)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            want.append(loss.item())
        with torch.no_grad():
            want_eval = _mean(ref, data[-1]).item()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-10,
                                   atol=1e-12)
        assert evaluated == pytest.approx(want_eval, rel=1e-10)
        M.assert_weights_match(model, ref, atol=1e-10, rtol=1e-9)
        return losses
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_decoder_pipeline_uses_the_callers_loss_over_the_batch_keys(world2, schedule):
    world2.run(loss_case, schedule=schedule)
