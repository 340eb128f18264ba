"""Decoder families under tensor parallelism against one process, on real gloo processes.

Each parity case (``_families.parity_case``) trains the tiny model of one family of
``_fam_decoder`` three AdamW steps single-process on the global batch and parallelized
on a dp=2 x tp=2 mesh, and compares every step's loss, the first step's gradients and
the last weights. ``tp_zero3``: the family's policy under ``policies.auto`` with ZeRO-3
over dp; ``tp_sp``: the same with Megatron sequence parallelism. Layouts a policy cannot
run are refused by ``plan`` (a fake mesh, no processes) with a typed error.

OPT trains in float64, to 1e-10: in float32 one element of ``fc1`` (ReLU, a gradient
near zero) ends 1.6e-4 from the single process after three Adam steps, which the float64
run shows is rounding.
"""

from __future__ import annotations

import pytest
import torch

import meshlab as ml

from tests import _families as F
from tests import _fam_decoder as D
from tests import _models as M

pytestmark = pytest.mark.timeout(600)

MOD = D.__name__
TP_ZERO3 = ("llama", "mistral", "qwen2", "qwen3", "cohere", "gpt2", "gptj", "bloom", "falcon",
            "falcon_alibi", "falcon_gqa")
TP_SP = ("gptj", "bloom", "falcon", "falcon_alibi", "falcon_gqa")


def _plan(name: str, spec_name: str):
    return ml.plan(F.build(D.FAMILIES[name]), M.spec(spec_name), ml.Mesh(dp=2, tp=2, fake=True))


def float64_case(rank, world, **kw):
    """``parity_case`` in float64, to 1e-10."""
    torch.set_default_dtype(torch.float64)
    try:
        return F.parity_case(rank, world, lr=1e-2, tols=(1e-10,) * 6, **kw)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("name", TP_ZERO3)
def test_tp_zero3_parity(world4, name):
    out = world4.run(F.parity_case, module=MOD, name=name, spec_name="tp_zero3")
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_opt_tp_zero3_parity_float64(world4):
    out = world4.run(float64_case, module=MOD, name="opt", spec_name="tp_zero3")
    assert all(o["losses"] == out[0]["losses"] for o in out)


@pytest.mark.parametrize("name", TP_SP)
def test_tp_sp_parity(world4, name):
    out = world4.run(F.parity_case, module=MOD, name=name, spec_name="tp_sp")
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_policies_lay_out_what_they_say():
    """The hand-written policies are the ones applied: fused q|k|v split whole heads
    (plain column-parallel), the ALiBi arguments cut to each rank's heads, the head counts
    divided, GPT-J on its regions rather than the translated plan (which marks none)."""
    from meshlab.transforms.shard._layout import tp_layout

    bloom = _plan("bloom", "tp_zero3")
    e = bloom["transformer.h.0.self_attention.query_key_value.weight"]
    assert e.mesh_spec == ml.P("tp", None) and "colwise" in e.tags, e
    layout, _ = tp_layout(bloom, 1)
    assert ("transformer.h.0.self_attention", "alibi", -3, 4, 2, 2) in layout.head_args
    assert ("transformer.h.0.self_attention", "num_heads", 2) in layout.attrs
    falcon, _ = tp_layout(_plan("falcon_alibi", "tp_zero3"), 1)
    assert {a[1] for a in falcon.head_args} == {"alibi", "attention_mask"}
    gptj, _ = tp_layout(_plan("gptj", "tp_sp"), 0)
    assert "transformer.h.0.attn" in gptj.regions and gptj.sequence_parallel


def test_own_heads_keeps_this_ranks_rows():
    from meshlab.transforms.shard._tp import own_heads

    B, H, S = 2, 4, 3
    alibi = torch.arange(B * H * S, dtype=torch.float32).reshape(B * H, 1, S)
    got = own_heads(alibi, -3, H, 2, 2)              # batch x heads on the first dim
    assert torch.equal(got, alibi.reshape(B, H, 1, S)[:, 2:].reshape(B * 2, 1, S))
    assert torch.equal(own_heads(alibi.reshape(B, H, 1, S), -3, H, 2, 2),
                       alibi.reshape(B, H, 1, S)[:, 2:])
    mask = torch.randn(B, H, S, S)
    assert torch.equal(own_heads(mask, 1, H, 0, 2), mask[:, :2])
    causal = torch.randn(B, 1, S, S)                 # broadcast over heads: kept whole
    assert own_heads(causal, -3, H, 2, 2) is causal
    with pytest.raises(ml.ConfigError, match="does not carry 4 heads"):
        own_heads(torch.randn(B, 3, S, S), 1, H, 0, 2)


def test_opt_sequence_parallel_is_refused():
    # OPT's layer flattens the hidden states to (batch x seq, hidden) before fc1 and has
    # no MLP module: nothing gathers the sequence shard fc1 would read.
    with pytest.raises(ml.ConfigError, match=r"layers\.0\.fc1: column-parallel outside every "
                                             r"tensor-parallel region, under sequence"):
        _plan("opt", "tp_sp")


def test_falcon_multi_query_is_refused():
    # One K/V head shared by every query head, fused behind them: no split gives each
    # rank whole heads.
    with pytest.raises(ml.ConfigError, match=r"self_attention\.num_kv_heads = 1 does not "
                                             r"divide over tp=2"):
        _plan("falcon_mqa", "tp_zero3")
