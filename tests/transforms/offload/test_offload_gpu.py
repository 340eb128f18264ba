"""``offload`` on one CUDA device (pinned host memory, copy streams, the C++ CPU AdamW),
against the same run without it."""

from __future__ import annotations

import os

import pytest
import torch

from tests import _models as M

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def one_rank():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29633")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(extra, data, chunk=None):
    import meshlab as ml

    spec = extra if extra is not None else ml.parallel.Identity()
    model = ml.parallelize(M.build("llama", vocab_size=96), spec, ml.Mesh(dp=1), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2)
    losses = []
    for i, b in enumerate(data):
        b = b.cuda()
        loss = M.loss_fn("llama")(model(input_ids=b), {"input_ids": b, "labels": b})
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if i < len(data) - 1:            # the last step's gradients stay for measure()
            opt.zero_grad()
    return model, opt, losses


@pytest.mark.parametrize("kw", [dict(optimizer=0.5), dict(optimizer=1.0, grads=1.0)])
def test_matches_no_offload_on_cuda(one_rank, kw):
    import meshlab as ml
    from meshlab.transforms.offload._install import OffloadPart

    data = M.batches(3, vocab=96)
    ref, _, want = _train(None, data)
    model, opt, got = _train(ml.offload(**kw, chunk_elements=2000), data)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), refp[n].detach(), atol=1e-5, rtol=1e-4)
    part = model._meshlab.part(OffloadPart)
    assert part.copied["d2h_bytes"] > 0 and part.copied["h2d_bytes"] > 0
    assert all(e.master.device.type == "cpu" and e.master.is_pinned() for e in part.entries)


def test_bf16_device_copies_and_memory_accounting(one_rank):
    import meshlab as ml
    from meshlab.transforms.offload._install import OffloadPart

    data = M.batches(4, vocab=96)
    model, opt, losses = _train(ml.precision("bf16") | ml.offload(optimizer=1.0,
                                                                   chunk_elements=2000), data)
    assert losses[-1] < losses[0]
    part = model._meshlab.part(OffloadPart)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(e.master.dtype == torch.float32 for e in part.entries)
    got = part.measure(opt)
    est = model._meshlab.plan.memory()
    host, dev = sum(got["host"].values()), sum(got["device"].values())
    assert abs(host - est.host) <= 0.1 * est.host, (got, est)
    assert abs(dev - est.total) <= 0.1 * est.total, (got, est)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_rest_on_the_host_under_fsdp2_units(one_rank, stage):
    """Everything offloaded beside ``data_parallel`` and ``zero_shard(1)`` (FSDP2 over a
    size-1 shard dimension), ``zero_shard(2)`` (units kept whole from the forward to the backward) and
    ``zero_shard(3)``: between steps every parameter's shard is in pinned
    host memory, and the losses and weights are the same run's without offload."""
    import meshlab as ml
    from meshlab.core.tensors import local

    data = M.batches(3, vocab=96)
    ref, _, want = _train(ml.zero_shard(stage, "dp"), data)
    assert all(local(p).device.type == "cuda" for p in ref.parameters())
    model, _, got = _train(ml.zero_shard(stage, "dp") | ml.offload(params=1.0, grads=1.0,
                                                                   optimizer=1.0), data)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    assert all(local(p).device.type == "cpu" and local(p).is_pinned()
               for p in model.parameters())
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(local(p).detach().cuda(), local(refp[n]).detach(),
                                   atol=1e-5, rtol=1e-4)
