"""Tensor parallelism with the attention left whole (the rules map ``heads`` and
``kv_heads`` to None, the MLP and vocabulary split over ``tp``), against one process in
float64 (``meshlab.verify``: losses, updates and weights of every step).

Before, the policy's per-head parts applied as if the heads were split:

* Qwen3's query and key norms (marked ``replicated_with_grad_allreduce``, as their data is
  this rank's heads where the attention is split) had their gradients summed over tp, where
  every rank saw every head: twice one process's gradient, the weights 5e-4 off after two
  steps, no error (the same in 13 other families with per-head norms);
* GPT-2 and BLOOM divided their attention's head counts by tp, and transformers' own
  forward failed on the whole projections with an untyped error.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(600)


def _build(family: str):
    if family != "bloom":
        return M.build(family)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("bloom", hidden_size=32, n_layer=2, n_head=4, vocab_size=97,
                               hidden_dropout=0.0, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def whole_attention_case(rank, world, family):
    import meshlab as ml

    rules = ml.Rules(heads=None, kv_heads=None, mlp="tp", vocab="tp", embed=None)
    data = [{"input_ids": b} for b in M.batches(2, batch=4, seq=8)]
    report = ml.verify(_build(family), ml.shard(ml.policies.auto, rules), ml.Mesh(tp=world),
                       data, optimizer=torch.optim.SGD, lr=0.1, dtype=torch.float64,
                       atol=1e-10, rtol=1e-9)
    return report.ok, str(report)


@pytest.mark.parametrize("family", ["qwen3", "gpt2", "bloom"])
def test_whole_attention_beside_a_split_mlp_trains_as_one_process(world2, family):
    for ok, text in world2.run(whole_attention_case, family=family):
        assert ok, text
