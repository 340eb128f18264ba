"""The layouts users run at scale, each trained on gloo against the single process with
``meshlab.verify`` (losses, every parameter's update and weight after each step).

* fine-tuning on one card: ``lora`` x ``zero_shard(3)`` x ``offload(params)`` (adapters
  trained, the frozen base sharded and its shards in host memory), against single-process
  peft with the same adapters;
* Colossal-AI's hybrid ``cpu_offload``: tensor parallelism x ZeRO-1 x ``offload(optimizer)``
  (the moments and fp32 masters of each rank's tensor-parallel shards on the host);
* torchtitan's dense layout: pipeline x ZeRO-3 (FSDP2 per stage) x tensor parallelism x
  ring attention, float64 on 16 ranks;
* the MoE layout: pipeline x expert x tensor parallelism x ZeRO-1 on a Mixtral (experts
  split over ``ep``, which is a data axis of the dense parameters, as Colossal-AI's
  ``MoeHybridParallelPlugin`` carves the expert axis out of the data axis).

Float32 where a room computes in float32 whatever the model's dtype (offload's CPU AdamW,
``grouped_mm``'s experts); float64 elsewhere. Offload's CPU AdamW takes ``eps=1``, which
moves a weight by its gradient's scale as SGD does (``test_table_parity``'s reasoning).
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M
from tests._world import World

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _verify(model, spec, mesh, *, dtype, optimizer=torch.optim.SGD, lr=0.1, options=None,
            reference=None, batch=4, steps=2, atol=None, rtol=None):
    import meshlab as ml

    data = M.batches(steps, batch=batch, seq=8)
    return ml.verify(model, spec, mesh, [{"input_ids": b} for b in data], optimizer=optimizer,
                     lr=lr, optimizer_options=options or {}, dtype=dtype, reference=reference,
                     atol=atol, rtol=rtol)


def lora_zero3_offload_case(rank, world):
    import meshlab as ml

    lora = ml.lora(r=2, target_modules=["q_proj", "v_proj"])
    spec = lora | ml.zero_shard(3, "dp") | ml.offload(params=1.0, grads=1.0, optimizer=1.0)
    model = M.build("llama")
    # verify's own reference: one process with the same adapters
    report = _verify(model, spec, ml.Mesh(dp=2), dtype=torch.float32,
                     optimizer=torch.optim.AdamW, options=dict(eps=1.0),
                     atol=1e-5, rtol=1e-4)
    from meshlab.transforms.offload import Choice

    choice = ml.plan(M.build("llama"), spec, ml.Mesh(dp=2, fake=True)).decision(Choice)
    return report.ok, str(report), sorted(choice.units)


def tp_zero1_offload_case(rank, world):
    import meshlab as ml

    spec = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | ml.zero_shard(1, "dp") | \
        ml.offload(optimizer=1.0)
    report = _verify(M.build("llama"), spec, ml.Mesh(dp=2, tp=2), dtype=torch.float32,
                     optimizer=torch.optim.AdamW, options=dict(eps=1.0), atol=1e-5,
                     rtol=1e-4)
    return report.ok, str(report), None


def moe_pp_ep_tp_zero1_case(rank, world):
    import meshlab as ml

    spec = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | ml.expert_route("ep") | \
        ml.zero_shard(1, "dp") | ml.pipeline("pp", microbatches=2)
    report = _verify(M.build("mixtral"), spec, ml.Mesh(pp=2, dp=2, ep=2, tp=2),
                     dtype=torch.float32, batch=8, atol=1e-5, rtol=1e-4)
    return report.ok, str(report), None


def dense_4d_case(rank, world):
    import meshlab as ml

    spec = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | ml.sequence("sp", "ring") | \
        ml.zero_shard(3, "dp") | ml.pipeline("pp", microbatches=2)
    model = M.build("llama")
    model.config._attn_implementation = "sdpa"      # the reference attends as the ring does
    report = _verify(model, spec, ml.Mesh(pp=2, dp=2, sp=2, tp=2), dtype=torch.float64,
                     batch=8)
    return report.ok, str(report), None


@pytest.fixture(scope="module")
def world16():
    w = World(16)
    yield w
    w.close()


def _check(out):
    ok, text, _ = out[0]
    assert all(o[:2] == out[0][:2] for o in out), "the ranks' reports differ"
    assert ok, text
    return out[0]


def test_lora_zero3_offload_params_matches_peft(world2):
    _, _, units = _check(world2.run(lora_zero3_offload_case))
    assert "model.layers.0" in units and "model.layers.1" in units, units   # on the host


def test_tensor_parallel_zero1_offload_matches_one_process(world4):
    _check(world4.run(tp_zero1_offload_case))


def test_moe_pipeline_expert_tensor_zero1_matches_one_process(world16):
    _check(world16.run(moe_pp_ep_tp_zero1_case, timeout=600))


def test_dense_pipeline_zero3_tensor_ring_matches_one_process(world16):
    _check(world16.run(dense_4d_case, timeout=600))
