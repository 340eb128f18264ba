"""Encoder-decoder families (T5, Whisper) under tensor parallelism against one process.

Each parity case (``_families.parity_case``) trains the tiny model of one family of
``_fam_encdec`` three AdamW steps single-process on the global batch and parallelized
on a dp=2 x tp=2 mesh, and compares every step's loss, the first step's gradients and
the last weights. ``tp_zero3``: the family's policy under ``policies.auto`` with ZeRO-3
over dp; ``tp``: tensor parallelism alone. Sequence parallelism and pipelining, which
meshlab does not run for encoder-decoder models, are refused by ``plan`` with a typed
error naming why, which the refusal tests check.
"""

from __future__ import annotations

import pytest
import torch

import meshlab as ml

from tests import _families as F
from tests import _fam_encdec as E
from tests import _models as M

pytestmark = pytest.mark.timeout(600)

MOD = E.__name__
NAMES = ("t5", "whisper")


def _plan(fam: F.Family, spec_name: str, **config):
    fam = F.Family({**fam.config, **config}, fam.auto, fam.batch, fam.loss, fam.inputs)
    return ml.plan(F.build(fam), M.spec(spec_name), ml.Mesh(dp=2, tp=2, fake=True))


@pytest.mark.parametrize("name,spec_name", [("t5", "tp_zero3"), ("whisper", "tp_zero3"),
                                            ("t5", "tp"), ("whisper", "tp"),
                                            ("t5_gated", "tp")])
def test_parity(world4, name, spec_name):
    out = world4.run(F.parity_case, module=MOD, name=name, spec_name=spec_name)
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_labels_give_the_models_own_loss(world4):
    """``model(..., labels=y).loss`` under a vocabulary-split head is the seq2seq loss
    (logits against the labels, unshifted) of one process; T5 builds its decoder inputs
    from the labels as its own forward does."""
    world4.run(labels_case)


def labels_case(rank, world):
    for name, inputs in (("t5", ("input_ids",)), ("whisper", ("input_features",
                                                              "decoder_input_ids"))):
        fam = E.FAMILIES[name]
        b = fam.batch(4, torch.Generator().manual_seed(3))
        ref = ml.init_weights(F.build(fam), seed=0)
        model = ml.parallelize(F.build(fam), M.spec("tp"), M.mesh_for("tp", world), seed=0)
        rt = model._meshlab
        dp_rank = torch.distributed.get_rank(rt.dp_group)
        local = {k: v.chunk(rt.dp_size)[dp_rank] for k, v in b.items()}
        got = model(**{k: local[k] for k in inputs}, labels=local["labels"]).loss
        mine = ref(**{k: local[k] for k in inputs}, labels=local["labels"]).loss
        torch.testing.assert_close(got, mine, atol=1e-5, rtol=1e-4)


def test_the_policies_shard_what_they_name():
    """Every projection of both stacks, the cross-attention and the vocabulary are split;
    T5's position bias is split over its heads, Whisper's convolutions stay whole."""
    p = _plan(E.FAMILIES["t5"], "tp")
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert p[bias].mesh_spec == ml.P(None, "tp")
    assert "embedding_colwise" in p[bias].tags
    for fqn in ("decoder.block.1.layer.1.EncDecAttention.k.weight", "shared.weight",
                "decoder.block.0.layer.2.DenseReluDense.wi.weight"):
        assert p[fqn].mesh_spec.dim_axes(0) == ("tp",), fqn
    assert p["decoder.block.1.layer.1.EncDecAttention.o.weight"].mesh_spec == ml.P(None, "tp")
    g = _plan(E.FAMILIES["t5_gated"], "tp")
    assert g["encoder.block.0.layer.1.DenseReluDense.wi_1.weight"].mesh_spec == \
        ml.P("tp", None)
    w = _plan(E.FAMILIES["whisper"], "tp")
    for fqn in ("model.encoder.conv1.weight", "model.encoder.embed_positions.weight",
                "model.decoder.embed_positions.weight"):
        assert w[fqn].mesh_spec == ml.P(), fqn
    assert w["model.decoder.layers.0.encoder_attn.v_proj.weight"].mesh_spec == \
        ml.P("tp", None)
    assert w["proj_out.weight"].mesh_spec.dim_axes(0) == ("tp",)


@pytest.mark.parametrize("name", NAMES)
def test_sequence_parallel_is_refused(name):
    with pytest.raises(ml.ConfigError, match="encoder-decoder model.*map 'seq' to None"):
        _plan(E.FAMILIES[name], "tp_sp")


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_is_refused(name):
    model = F.build(E.FAMILIES[name])
    with pytest.raises(ml.ConfigError, match="encoder-decoder model.*use zero_shard, shard"):
        ml.plan(model, ml.pipeline(), ml.Mesh(pp=2, fake=True))


def test_heads_that_do_not_divide_are_refused():
    """3 heads over tp=2: a rank would hold part of a head (of the projections and of
    the position bias)."""
    with pytest.raises(ml.SpecError, match="splits 3 attention heads over tp = 2 shards"):
        _plan(E.FAMILIES["t5"], "tp", num_heads=3)


def test_a_replicated_position_bias_is_refused():
    """Left whole inside the split attention, the bias would feed every head to ranks
    holding half of them (and its gradient would be partial)."""
    pol = ml.policies.get("t5").without(
        "*.block.*.layer.0.SelfAttention.relative_attention_bias")
    model = F.build(E.FAMILIES["t5"])
    with pytest.raises(ml.ConfigError, match="relative_attention_bias"):
        ml.plan(model, ml.shard(pol, ml.Rules(**M.TP_RULES)), ml.Mesh(dp=2, tp=2, fake=True))
