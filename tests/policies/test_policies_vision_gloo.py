"""Vision families under tensor parallelism against one process, on real gloo processes.

Each parity case (``_families.parity_case``) trains the tiny model of one family of
``_fam_vision`` three AdamW steps single-process on the global batch and parallelized
on a dp=2 x tp=2 mesh, and compares every step's loss, the first step's gradients and
the last weights (float32, the harness's tolerances). ``tp_zero3``: the family's policy
under ``policies.auto`` with ZeRO-3 over dp; ``tp_sp``: tensor and sequence parallelism.

ViT runs sequence parallel where its token count (patches + CLS) divides over tp; SAM
and BLIP-2 refuse it in ``plan`` (a fake mesh, no processes) with a ConfigError.
"""

from __future__ import annotations

import pytest

import meshlab as ml

from tests import _families as F
from tests import _fam_vision as V
from tests import _models as M

pytestmark = pytest.mark.timeout(600)

MOD = V.__name__


def _plan(name: str, spec_name: str):
    return ml.plan(F.build(V.FAMILIES[name]), M.spec(spec_name), ml.Mesh(dp=2, tp=2, fake=True))


@pytest.mark.parametrize("spec_name", ["tp_zero3", "tp"])
@pytest.mark.parametrize("name", ["vit", "sam", "blip-2"])
def test_parity(world4, name, spec_name):
    out = world4.run(F.parity_case, module=MOD, name=name, spec_name=spec_name)
    assert all(o["losses"] == out[0]["losses"] for o in out)      # every rank agrees


def test_vit_sequence_parallel_matches_one_process(world4):
    """12 px, 4 px patches: 9 patches and the CLS token, 10 tokens over tp=2."""
    world4.run(F.parity_case, module=MOD, name="vit_sp", spec_name="tp_sp")


def odd_tokens_case(rank, world):
    """16 px: 16 patches and the CLS token, 17 tokens, which do not split over tp=2."""
    import torch

    fam = V.FAMILIES["vit"]
    model = ml.parallelize(F.build(fam), M.spec("tp_sp"), M.mesh_for("tp_sp", world), seed=0)
    rt = model._meshlab
    x = torch.zeros(4 // rt.dp_size, 3, 16, 16)
    try:
        model(pixel_values=x)
    except ml.SpecError as e:
        return str(e)
    return None


def test_vit_sequence_parallel_refuses_odd_token_count(world4):
    out = world4.run(odd_tokens_case)
    assert all(o is not None and "sequence length 17" in o for o in out), out


def test_vit_plan_splits_heads_and_mlp():
    p = _plan("vit", "tp")
    assert p["vit.layers.0.attention.q_proj.weight"].mesh_spec == ml.P("tp", None)
    assert p["vit.layers.0.attention.o_proj.weight"].mesh_spec == ml.P(None, "tp")
    assert p["vit.layers.0.mlp.fc1.weight"].mesh_spec == ml.P("tp", None)
    assert p["vit.embeddings.patch_embeddings.projection.weight"].mesh_spec == ml.P()
    assert p["classifier.weight"].mesh_spec == ml.P()


def test_sam_plan():
    """Packed qkv split per part; the shared relative positions replicated with their
    gradient summed over tp; the mask decoder's attention and MLPs split."""
    p = _plan("sam", "tp")
    qkv = p["vision_encoder.layers.0.attn.qkv.weight"]
    assert qkv.mesh_spec == ml.P("tp", None) and "packed_qkv_colwise" in qkv.tags
    assert "replicated_with_grad_allreduce" in p["vision_encoder.layers.0.attn.rel_pos_h"].tags
    dec = "mask_decoder.transformer.layers.0"
    assert p[f"{dec}.cross_attn_token_to_image.k_proj.weight"].mesh_spec == ml.P("tp", None)
    assert p[f"{dec}.cross_attn_token_to_image.out_proj.weight"].mesh_spec == ml.P(None, "tp")
    assert p[f"{dec}.mlp.lin2.weight"].mesh_spec == ml.P(None, "tp")


def test_sam_refuses_sequence_parallel():
    with pytest.raises(ml.ConfigError, match=r"region mask_decoder\.transformer\..* lies "
                                             r"outside the repeated blocks"):
        _plan("sam", "tp_sp")


def test_sam_rel_pos_without_grad_sum_is_refused():
    """Without 'replicated_with_grad_allreduce' the relative-position tables, which each
    rank's heads use, would keep a partial gradient: the layout check refuses it."""
    pol = ml.policies.get("sam").without("vision_encoder.layers.*.attn")
    with pytest.raises(ml.ConfigError, match=r"attn\.rel_pos_h: replicated.*partial"):
        ml.plan(F.build(V.FAMILIES["sam"]), ml.shard(pol, ml.Rules(**M.TP_RULES)),
                ml.Mesh(dp=2, tp=2, fake=True))


def test_blip2_plan():
    """The image encoder's attention stays whole (Blip2Attention reshapes by its input's
    width); its MLP, the Q-Former and the OPT language model are split."""
    p = _plan("blip-2", "tp")
    assert p["vision_model.encoder.layers.0.self_attn.qkv.weight"].mesh_spec == ml.P()
    assert p["vision_model.encoder.layers.0.mlp.fc1.weight"].mesh_spec == ml.P("tp", None)
    cross = "qformer.encoder.layer.0.crossattention"
    assert p[f"{cross}.attention.key.weight"].mesh_spec == ml.P("tp", None)
    assert p[f"{cross}.output.dense.weight"].mesh_spec == ml.P(None, "tp")
    assert p["language_model.model.decoder.layers.0.fc1.weight"].mesh_spec == ml.P("tp", None)
    assert p["language_model.model.decoder.embed_tokens.weight"].mesh_spec == ml.P("tp", None)


def test_blip2_refuses_sequence_parallel():
    with pytest.raises(ml.ConfigError, match=r"sequence of the blocks of 3 stacks"):
        _plan("blip-2", "tp_sp")
