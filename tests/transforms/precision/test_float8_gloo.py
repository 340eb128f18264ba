"""precision('fp8') on 2 gloo ranks, exact against one process.

A dynamic float8 scale is the largest magnitude of the tensor a layer is given: each data
rank takes it over the batch it holds. The single process that computes what the data
ranks compute runs each rank's batch as a microbatch, with the same layers in float8
(torchao's ``Float8Linear``, swapped by the same decision) under the same bf16 autocast,
and averages the microbatches' gradients as the ranks' all-reduce does. Against it the
layout trains to float32 rounding: a term missing, doubled or taken over the wrong batch
would be a float8 rounding step (6%) or more. Three SGD steps of a two-block Llama whose
every block linear is float8; the output head stays bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.timeout(600)

STEPS, LR = 3, 0.1
# ZeRO-3: the first step's loss is exact against FSDP2's mixed precision run on one process
# (_fsdp2_microbatches); the updates then differ by rounding in the gradients' path, which
# float8 magnifies: a weight whose largest value moves by a rounding moves its dynamic
# scale, and every value of it may round one float8 step (2^-4) apart. Measured: losses
# 2.4e-4 apart (relative 5e-5) after three steps, weights within 1.6% of the largest
# (bf16 alone, the same run: 0.16%); with the reference's gradients halved: 13%.
_ZERO3 = (1e-3, 3e-2)
# every op but the fused loss, whose head the reference's Hugging Face loss computes apart
_FUSED = ("rms_norm", "rotary", "attention", "mlp")


def _spec(extra: str, recipe: str):
    import meshlab as ml

    base = ml.precision("fp8", recipe=recipe)
    return {"dp": base | ml.data_parallel("dp"),
            "zero1": base | ml.zero_shard(1, "dp"),
            "zero3": base | ml.zero_shard(3, "dp"),
            "remat": base | ml.data_parallel("dp") | ml.remat("full"),
            "fuse": base | ml.data_parallel("dp") | ml.fuse(*_FUSED),
            "compile": base | ml.data_parallel("dp") | ml.compile_blocks(backend="aot_eager"),
            }[extra]


def float8_case(rank, world, extra, recipe):
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.transforms.fuse import fuse_model
    from meshlab.transforms.precision._float8 import Float8Layers, convert

    spec = _spec(extra, recipe)
    data = M.batches(STEPS, batch=4, seq=8)
    model = ml.parallelize(M.build("llama"), spec, ml.Mesh(dp=world), seed=0)
    rt = model._meshlab
    chosen = rt.plan.decision(Float8Layers)
    swapped = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    assert swapped == sorted(chosen.layers) and len(swapped) == 14, swapped
    opt = ml.optimizer(model, torch.optim.SGD, lr=LR)
    losses = []
    for b in data:
        local = b.chunk(world)[rank]
        loss = torch.tensor([float(ml.step(model, opt, {"input_ids": local}))],
                            dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(float(loss) / world)

    ref = ml.init_weights(M.build("llama"), seed=0)
    convert(ref, chosen)
    if extra == "fuse":                 # the same fused ops, routed after the swap
        fuse_model(ref, _FUSED)
    ref_losses = (_fsdp2_microbatches if extra == "zero3" else _microbatches)(ref, data, world)
    tol = _ZERO3 if extra == "zero3" else (1e-5, 1e-5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=tol[0],
                               rtol=tol[0])
    worst = 0.0
    mine = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        w = M.full(mine[n]).detach()
        worst = max(worst, float((w - p.detach()).abs().max() / p.detach().abs().max()))
    return {"losses": losses, "worst": worst}


def _microbatches(ref, data, world) -> list[float]:
    """SGD on one process, each step's batch as ``world`` microbatches under bf16 autocast,
    their gradients averaged (the data ranks' all-reduce)."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for b in data:
        total = 0.0
        for micro in b.chunk(world):        # what each data rank holds
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ref(input_ids=micro, labels=micro).loss
            (loss / world).backward()
            total += float(loss) / world
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _fsdp2_microbatches(ref, data, world) -> list[float]:
    """What FSDP2's mixed precision computes, on one process: the forward and backward on
    bf16 copies of fp32 masters (no autocast), each microbatch's bf16 gradients cast to
    fp32 and averaged there, SGD on the masters."""
    import copy

    work = copy.deepcopy(ref).to(torch.bfloat16)
    masters = list(ref.parameters())
    opt = torch.optim.SGD(masters, lr=LR)
    losses = []
    for b in data:
        total, grads = 0.0, [torch.zeros_like(p) for p in masters]
        for micro in b.chunk(world):
            loss = work(input_ids=micro, labels=micro).loss
            loss.backward()
            total += float(loss) / world
            for g, w in zip(grads, work.parameters()):
                g += w.grad.float() / world
                w.grad = None
        for p, g in zip(masters, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for w, p in zip(work.parameters(), masters):
                w.copy_(p)
        losses.append(total)
    return losses


@pytest.mark.parametrize("extra", ["dp", "zero1", "zero3", "remat", "fuse", "compile"])
def test_float8_matches_one_process_by_microbatches(world2, extra):
    out = world2.run(float8_case, extra=extra, recipe="tensorwise")
    assert all(o["worst"] < (_ZERO3 if extra == "zero3" else (1e-5, 1e-5))[1] for o in out), out


def test_rowwise_recipe(world2):
    out = world2.run(float8_case, extra="dp", recipe="rowwise")
    assert all(o["worst"] < 1e-5 for o in out), out

