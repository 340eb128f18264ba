"""The transform protocol from outside meshlab, and plan refusing what parallelize refuses.

``ScaleGrads`` is written here against the public protocol only (``meshlab.transforms``):
it declares its row of the composition table (it composes with ``shard`` and
``zero_shard(1)``), composes with ``shard | zero_shard`` by ``|``, plans on a fake mesh,
adds rows to ``plan.memory()``, and on 2 gloo ranks its part of gradient synchronization
scales every gradient — so SGD at ``lr`` matches the single process at ``lr * factor``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Mapping

import pytest
import torch

import meshlab as ml
from meshlab.transforms import Cell, MemRow, Part, Phase, Transform, composes

from tests import _models as M

pytestmark = pytest.mark.timeout(600)


@dataclasses.dataclass
class _ScalePart(Part):
    order: ClassVar[int] = 1         # before the data-parallel reductions
    factor: float
    calls: int = 0

    def sync_grads(self, params):
        self.calls += 1
        for _, p in params:
            if p.grad is not None:
                p.grad.mul_(self.factor)


@dataclasses.dataclass(frozen=True)
class ScaleGrads(Transform):
    """Scale every gradient by ``factor`` after backward; keeps one fp32 scratch copy of
    each gradient (counted in ``plan.memory()`` as 'scratch')."""

    kind: ClassVar[str] = "scale_grads"
    phase: ClassVar[Phase] = Phase.USER
    # its row of the composition table: the rows it is shown with (any other is not yet)
    composition: ClassVar[Mapping[str, Cell]] = {
        "zero_shard(1)": composes(
            "tests/transforms/test_rooms.py::test_external_transform_runs_on_two_ranks"),
        "shard": composes(),
    }
    factor: float = 0.5

    def check(self, plan):
        if not 0 < self.factor <= 1:
            raise ml.ConfigError(f"{self!r}: factor must be in (0, 1]")

    def install(self, ctx):
        return _ScalePart(self.factor)

    def memory(self, plan, rows):
        return rows + [MemRow(r.fqn, "scratch", "float32", r.shape)
                       for r in rows if r.category == "grads"]


def _spec(factor=0.5):
    rules = ml.Rules(batch="dp", heads=None, kv_heads=None, mlp=None, vocab=None, embed=None)
    return ml.shard(ml.policies.auto, rules) | ml.zero_shard(1, "dp") | ScaleGrads(factor)


def test_external_transform_plans_on_a_fake_mesh():
    model = M.build("llama")
    spec = _spec()
    assert isinstance(spec, ml.parallel.Compose) and len(spec.parts) == 3
    p = ml.plan(model, spec, ml.Mesh(dp=2, fake=True))
    assert p.get(ScaleGrads) == ScaleGrads(0.5)
    mem = p.memory()
    grads_full = sum(e.numel * 4 for e in p if not e.tied_to)   # ZeRO-1 keeps grads whole
    assert mem.by_category["scratch"]["float32"] == grads_full + \
        sum(4 * (-(-e.shape[0] // 2)) * (e.numel // e.shape[0]) for e in p if not e.tied_to)
    assert mem.total == sum(sum(v.values()) for v in mem.by_category.values())
    assert "scale_grads" in p.to_json()
    assert ml.Plan.from_json(p.to_json()) == p
    with pytest.raises(ml.ConfigError, match="factor must be"):
        ml.plan(model, _spec(2.0), ml.Mesh(dp=2, fake=True))


def scaled_case(rank, world):
    import torch.distributed as dist

    lr, factor = 0.1, 0.5
    data = M.batches(2)
    ref = ml.init_weights(M.build("llama"), seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr * factor)
    for b in data:
        M.loss_fn("llama")(ref(input_ids=b), {"input_ids": b, "labels": b}).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = ml.parallelize(M.build("llama"), _spec(factor), ml.Mesh(dp=world), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=lr)
    rt = model._meshlab
    part = rt.part(_ScalePart)
    r = dist.get_rank(rt.dp_group)
    for b in data:
        local = b.chunk(world)[r]
        ml.step(model, opt, {"input_ids": local, "labels": local})
    M.assert_weights_match(model, ref, atol=1e-5, rtol=1e-4)
    return part.calls


def test_external_transform_runs_on_two_ranks(world2):
    assert world2.run(scaled_case) == [2, 2]


def test_external_transform_has_a_row_in_the_composition_table():
    from meshlab.transforms import composition

    assert "scale_grads" in composition.rows() and "scale_grads" not in composition.ROWS
    table = composition.table()
    assert table[("zero_shard(1)", "scale_grads")].test.endswith(
        "::test_external_transform_runs_on_two_ranks")
    assert table[("shard", "scale_grads")].status == "composes"
    # a row it declares nothing for is not yet, the reason naming the transform
    other = table[("zero_shard(3)", "scale_grads")]
    assert other.status == "not yet" and "scale_grads" in other.reason
    with pytest.raises(ml.ConfigError, match=r"scale_grads x zero_shard\(3\)|zero_shard\(3\) "
                                             r"x scale_grads"):
        ml.plan(M.build("llama"), ml.zero_shard(3, "dp") | ScaleGrads(),
                ml.Mesh(dp=2, fake=True))


# -- plan refuses exactly what parallelize refuses ------------------------------------
_TP = dict(batch=("dp", None), heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
REFUSED = [
    # (name, spec, mesh, error type, message fragment)
    ("tp over two axes", lambda: ml.shard(ml.policies.auto, ml.Rules(
        heads="tp", kv_heads="tp", mlp="sp", vocab="tp", embed=None, batch="dp")),
     dict(dp=1, sp=2, tp=2), ml.ConfigError, "several mesh axes"),
    ("zero 1 on an axis specs shard", lambda: ml.shard(ml.policies.auto, ml.Rules(
        **{**_TP, "embed": "dp"})) | ml.zero_shard(1, "dp"),
     dict(dp=2, tp=2), ml.ConfigError, "keeps parameters whole"),
    ("zero bubble with zero 3", lambda: ml.zero_shard(3, "dp") | ml.pipeline(
        "pp", schedule="zero_bubble", virtual_stages=1), dict(pp=2, dp=2), ml.ConfigError,
     "use schedule='1f1b', 'interleaved' or 'gpipe'"),
    ("two rings", lambda: ml.sequence("sp", "ring") | ml.sequence("cp", "ring"),
     dict(sp=2, cp=2), ml.ConfigError, "two sequence transforms in one spec"),
    ("sequence axis not in the mesh", lambda: ml.sequence("sp"),
     dict(dp=2), ml.ConfigError, "is not a mesh axis"),
    ("more stages than blocks", lambda: ml.pipeline("pp"),
     dict(pp=4), ml.ConfigError, "cannot fill 4 stages"),
    ("ulysses heads do not divide", lambda: ml.sequence("sp"),
     dict(sp=3), ml.ConfigError, "attention heads do not divide"),
    ("zero axis not in the mesh", lambda: ml.zero_shard(2, "fsdp"),
     dict(dp=2), ml.ConfigError, "'fsdp' is not a mesh axis"),
]


@pytest.mark.parametrize("name,spec,mesh,err,msg", REFUSED, ids=[r[0] for r in REFUSED])
def test_plan_refuses_on_a_fake_mesh(name, spec, mesh, err, msg):
    import torch.distributed as dist

    assert not dist.is_initialized()       # no process group: refused by the plan alone
    with pytest.raises(err, match=msg.replace("(", r"\(").replace(")", r"\)")):
        ml.plan(M.build("llama"), spec(), ml.Mesh(**mesh, fake=True))


def refused_case(rank, world, index):
    name, spec, mesh, err, msg = REFUSED[index]
    try:
        ml.parallelize(M.build("llama"), spec(), ml.Mesh(**mesh))
    except err as e:
        return type(e).__name__, str(e)
    raise AssertionError(f"{name}: parallelize accepted it")


def _world_size(mesh):
    import math

    return math.prod(mesh.values())


def _same_refusal(world, index):
    name, spec, mesh, err, msg = REFUSED[index]
    with pytest.raises(err) as planned:
        ml.plan(M.build("llama"), spec(), ml.Mesh(**mesh, fake=True))
    got = world.run(refused_case, index=index)
    assert all(g == (type(planned.value).__name__, str(planned.value)) for g in got), got


def _sized(n):
    """The cases whose mesh has ``n`` ranks, for ``parametrize``."""
    picked = [(i, r[0]) for i, r in enumerate(REFUSED) if _world_size(r[2]) == n]
    return dict(argnames="index", argvalues=[i for i, _ in picked], ids=[k for _, k in picked])


@pytest.mark.parametrize(**_sized(4))
def test_parallelize_refuses_the_same(world4, index):
    _same_refusal(world4, index)


@pytest.mark.parametrize(**_sized(2))
def test_parallelize_refuses_the_same_on_two_ranks(world2, index):
    _same_refusal(world2, index)


# -- 2-D layouts written the JAX way run: FSDP over 'dp' composed with TP over 'tp' ---------
def fsdp_2d_case(rank, world):
    from tests.transforms.test_parallel_gloo import parity_case

    return parity_case(rank, world, family="llama", spec_name="tp_fsdp_2d")


def test_fsdp_2d_layout_matches_one_process(world4):
    rules = ml.Rules(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed="dp")
    p = ml.plan(M.build("llama"), ml.shard(ml.policies.auto, rules), ml.Mesh(dp=2, tp=2, fake=True))
    assert p.roles.fsdp == ("dp",) and p.roles.tp == "tp" and not p.not_runnable
    assert p["model.layers.0.self_attn.q_proj.weight"].mesh_spec == ml.P("tp", "dp")
    out = world4.run(fsdp_2d_case)
    assert all(o["losses"] == out[0]["losses"] for o in out)


def unused_case(rank, world):
    try:
        ml.parallelize(M.build("llama"), ml.zero_shard(3, "dp"), ml.Mesh(dp=2, tp=2))
    except ml.ConfigError as e:
        return str(e)
    raise AssertionError("an unused axis was accepted")


def test_unused_axis_is_shown_by_plan_and_refused_by_parallelize(world4):
    p = ml.plan(M.build("llama"), ml.zero_shard(3, "dp"), ml.Mesh(dp=2, tp=2, fake=True))
    assert not p.runnable and "used by no transform" in p.not_runnable[0]
    assert "parallelize cannot run this layout" in str(p)
    assert world4.run(unused_case) == [p.not_runnable[0]] * 4


def _mlp_in_two_layers():
    model = M.build("llama")
    model.model.layers[1].mlp = model.model.layers[0].mlp
    return model


@pytest.mark.parametrize("spec,says", [
    (lambda: ml.zero_shard(3, "dp"), "FSDP2 unit by unit"),
    (lambda: ml.zero_shard(2, "dp"), "FSDP2 unit by unit"),
    (lambda: ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)),
     "is split over 'tp': tensor parallelism splits each module where it sits")])
def test_a_module_placed_in_two_blocks_is_refused_where_blocks_are_sharded(spec, says):
    """One MLP object in two decoder layers: ZeRO-3 failed inside FSDP2 with an untyped
    "Cannot concatenate overlapping meshes", tensor parallelism with a message naming the
    module's class as '?'."""
    with pytest.raises(ml.ConfigError, match="model.layers.1.mlp.gate_proj is "
                                             "model.layers.0.mlp.gate_proj .*" + says):
        ml.plan(_mlp_in_two_layers(), spec(), ml.Mesh(dp=2, tp=2, fake=True))
    # data parallelism and ZeRO-1 keep every parameter whole: nothing to refuse
    for ok in (ml.data_parallel("dp"), ml.zero_shard(1, "dp")):
        ml.plan(_mlp_in_two_layers(), ok, ml.Mesh(dp=2, fake=True))


def test_a_module_placed_twice_outside_the_blocks_is_planned():
    """One embedding object as a T5's shared, encoder and decoder embedding (as
    transformers placed it before tying weights instead), outside every block: FSDP2's
    root unit and the vocabulary split hold it once."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   dropout_rate=0.0)
    with torch.device("meta"):
        model = T5ForConditionalGeneration(cfg)
    model.encoder.embed_tokens = model.decoder.embed_tokens = model.shared
    ml.plan(model, ml.zero_shard(3, "dp"), ml.Mesh(dp=2, fake=True))
    ml.plan(model, ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)),
            ml.Mesh(dp=2, tp=2, fake=True))
