"""Bad arguments are refused where they enter, with a typed error that names the argument,
the rule and the fix; layouts the forward cannot run are refused by ``plan`` (and so by
``parallelize``); a batch that does not divide into microbatches raises on every rank
before any collective."""

from __future__ import annotations

import math
import time

import pytest
import torch

import meshlab as ml
from meshlab import P, presets
from meshlab.policies import ModuleRule, Policy

from tests import _models as M

pytestmark = pytest.mark.timeout(600)
TINY = presets.build("tiny-llama")        # hidden 64, 4 heads of 16, 2 KV heads
RULES = ml.Rules(batch=("dp", None), heads="tp", kv_heads="tp", mlp="tp", vocab="tp",
                 embed=None)


def _raises(err, *needles):
    """``pytest.raises(err)`` whose message holds every needle (literally)."""
    import re

    return pytest.raises(err, match="(?s)" + "".join(f"(?=.*{re.escape(n)})" for n in needles))


# -- the values that were untyped or silently accepted --------------------------------------
@pytest.mark.parametrize("call,err,needles", [
    (lambda: ml.zero_shard(1, axis=3), ml.ConfigError, ("axis=3", "mesh axis name")),
    (lambda: ml.zero_shard(stage=True), ml.ConfigError, ("stage=True", "0 to 3", "bool")),
    (lambda: ml.zero_shard(stage=1.0), ml.ConfigError, ("stage=1.0", "float")),
    (lambda: ml.data_parallel(("dp", "dp")), ml.ConfigError, ("distinct",)),
    (lambda: ml.pipeline(microbatches="4"), ml.ConfigError, ("microbatches='4'", ">= 1")),
    (lambda: ml.pipeline(microbatches=2.5), ml.ConfigError, ("microbatches=2.5", "float")),
    (lambda: ml.pipeline(microbatches=0), ml.ConfigError, ("microbatches=0",)),
    (lambda: ml.pipeline(virtual_stages=0), ml.ConfigError, ("virtual_stages=0", ">= 1")),
    (lambda: ml.pipeline(schedule=["1f1b"]), ml.ConfigError, ("schedule", "'gpipe'")),
    (lambda: ml.pipeline(layers_per_stage="22"), ml.ConfigError, ("layers_per_stage",)),
    (lambda: ml.precision(None), ml.ConfigError, ("compute=None", "'bf16'")),
    (lambda: ml.precision("fp16", init_scale="big"), ml.ConfigError, ("init_scale='big'",)),
    (lambda: ml.precision("fp16", growth_interval=0), ml.ConfigError, ("growth_interval=0",)),
    (lambda: ml.precision("fp16", loss_scale=0), ml.ConfigError, ("loss_scale=0", "> 0")),
    (lambda: ml.precision("fp16", loss_scale=math.nan), ml.ConfigError, ("loss_scale=nan",)),
    (lambda: ml.precision("fp16", loss_scale=True), ml.ConfigError, ("loss_scale=True",)),
    (lambda: ml.remat(["full"]), ml.ConfigError, ("policy", "'selective'")),
    (lambda: ml.sequence("sp", mode=["ring"]), ml.ConfigError, ("mode", "'all_to_all'")),
    (lambda: ml.fuse(["loss"]), ml.ConfigError, ("fuse(['loss'])", "'rms_norm'")),
    (lambda: ml.shard({3: P("tp")}), ml.SpecError, ("glob 3", "strings")),
    (lambda: ml.shard({"layers.[z-a].weight": P("tp")}), ml.SpecError,
     ("'layers.[z-a].weight'", "low to high")),
    (lambda: ml.shard({"lm_head.weight": P(partial="dp")}), ml.SpecError,
     ("partial", "parameter is a whole value")),
    (lambda: ml.shard({"lm_head.weight": P("tp")}, rules=3), ml.RulesError, ("rules=3",)),
    (lambda: ml.shard({"lm_head.weight": P("tp")}, activations=["x"]), ml.SpecError,
     ("activations",)),
    (lambda: ml.Mesh(dp=2 ** 16, tp=2 ** 16, fake=True), ml.MeshError,
     ("4,294,967,296 ranks", "32-bit")),
    (lambda: ml.Mesh([("dp", 2)], fake=True), ml.MeshError, ("dict of axis name",)),
    (lambda: ml.Mesh(dp=2, fake=1), ml.MeshError, ("fake=1",)),
    (lambda: ml.Mesh.parse(3), ml.MeshError, ("Mesh.parse(3)",)),
    (lambda: ml.Rules(mlp="t p"), ml.RulesError, ("'t p'", "identifiers")),
    (lambda: ml.Rules([("mlp",)]), ml.RulesError, ("each pair",)),
    (lambda: ml.Rules(3), ml.RulesError, ("Rules(3)",)),
    (lambda: ml.Rules.from_json({"mlp": "tp"}), ml.RulesError, ("Rules.to_json()",)),
    (lambda: P.from_json([1]), ml.SpecError, ("P.to_json()",)),
    (lambda: P("dp").dim_axes(1.5), ml.SpecError, ("dim=1.5",)),
])
def test_bad_argument_raises_a_typed_error_naming_it(call, err, needles):
    with _raises(err, *needles):
        call()


def test_wrong_kinds_are_also_type_errors():
    # The typed errors of a wrong kind are TypeErrors too, as Python's own would be.
    with pytest.raises(TypeError):
        ml.Rules(mlp="tp") | {"heads": "tp"}
    with pytest.raises(ml.RulesError):
        {"heads": "tp"} | ml.Rules(mlp="tp")
    with pytest.raises(ml.ConfigError) as e:
        ml.plan(TINY, {"lm_head.weight": P("tp")}, ml.Mesh(tp=2, fake=True))
    assert isinstance(e.value, TypeError) and "shard({...})" in str(e.value)
    with _raises(ml.MeshError, "meshlab.Mesh"):
        ml.plan(TINY, None, {"tp": 2})
    with _raises(ml.ConfigError, "uneven"):
        ml.plan(TINY, None, ml.Mesh(dp=2, fake=True), uneven="yes")


def test_plan_from_json_of_bad_text_is_a_plan_error():
    good = ml.plan(TINY, ml.shard(ml.policies.auto, RULES), ml.Mesh(tp=2, fake=True))
    for text, needle in [("not json", "not JSON"), ("[1, 2]", "not a meshlab plan"),
                         ('{"format": "meshlab.plan/1"}', "missing or malformed"),
                         (good.to_json().replace('"fqn"', '"name"'), "missing or malformed"),
                         (b"\xff\xfe", "not JSON"), (3, "JSON text")]:
        with _raises(ml.PlanError, needle):
            ml.Plan.from_json(text)
    assert ml.Plan.from_json(good.to_json()).fqns == good.fqns


def test_large_fake_meshes_plan_without_building_every_rank():
    t0 = time.perf_counter()
    mesh = ml.Mesh(dp=2 ** 15, tp=2 ** 15, fake=True)          # 2**30 ranks, no array
    assert mesh.size == 2 ** 30 and mesh.coordinate(2 ** 30 - 1) == {"dp": 2 ** 15 - 1,
                                                                       "tp": 2 ** 15 - 1}
    assert list(mesh["tp"].ranks[:3]) == [0, 1, 2] and mesh.flatten("dp", "tp").size == 2 ** 30
    assert mesh == ml.Mesh(dp=2 ** 15, tp=2 ** 15, fake=True)
    assert time.perf_counter() - t0 < 5
    with _raises(ml.MeshError, "not part of"):
        mesh.coordinate(2 ** 30)
    small = ml.Mesh(dp=2, tp=3, fake=True)
    assert small.ranks.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert small.coordinate(4) == {"dp": 1, "tp": 1}
    assert small == ml.Mesh(dp=2, tp=3, fake=True, _ranks=small.ranks)


def test_comm_and_memory_arguments_are_checked():
    p = ml.plan(TINY, ml.shard(ml.policies.auto, RULES), ml.Mesh(dp=2, tp=2, fake=True))
    with _raises(ml.ConfigError, "batch=-1", ">= 1"):
        p.comm(batch=-1, seq=8)
    with _raises(ml.ConfigError, "seq=2.5"):
        p.comm(batch=2, seq=2.5)
    with _raises(ml.ConfigError, "needs both batch= ", "seq="):
        p.comm(batch=2)
    with _raises(ml.ConfigError, "coord"):
        p.comm(coord={"pp": 0})
    with _raises(ml.ConfigError, "coord['tp']", "0 to 1"):
        p.comm(coord={"dp": 0, "tp": 2})
    with _raises(ml.ConfigError, "optimizer='lion'", "'adamw'"):
        p.memory(optimizer="lion")
    with _raises(ml.PlanError, "not bound"):
        ml.trace(TINY).comm()
    assert p.comm(batch=2, seq=8, coord={"dp": 1, "tp": 0}).bytes("all_reduce") > 0


# -- layouts the forward cannot run, refused by plan ----------------------------------------
def _llama_policy():
    return ml.policies.get("llama", TINY.config.base_model_tp_plan)


def _kv_mid_head_specs():
    """K/V projections (2 heads of 16) split over tp=4 by specs that bypass the logical
    ``kv_heads`` (which would replicate them): each rank would hold half a head."""
    k = "model.layers.*.self_attn.k_proj.weight"
    without_k = _llama_policy().without("layers.*.self_attn.k_proj")
    return {
        "glob specs (DTensor mode)": ml.shard({k: P("tp", None)}),
        "glob specs beside a policy": ml.shard(without_k, RULES) | ml.shard({k: P("tp", None)}),
        "a policy's params": ml.shard(without_k + Policy("k", params=(
            ("layers.*.self_attn.k_proj.weight", P("tp", None)),)), RULES),
        "a policy's axis override": ml.shard(_llama_policy() + Policy("k", modules=(
            ModuleRule("layers.*.self_attn.k_proj", "colwise", axis="heads"),)), RULES),
    }


@pytest.mark.parametrize("name", list(_kv_mid_head_specs()))
def test_kv_heads_split_mid_head_are_refused(name):
    with _raises(ml.ConfigError, "k_proj.weight", "splits the 2 heads", "head_dim 16",
                 "2 % 4 != 0", "kv_heads"):
        ml.plan(TINY, _kv_mid_head_specs()[name], ml.Mesh(tp=4, fake=True))


def test_heads_split_at_head_boundaries_still_plan():
    # logical kv_heads fewer than the shards are replicated; 2 KV heads over tp=2 split
    p = ml.plan(TINY, ml.shard(ml.policies.auto, RULES), ml.Mesh(tp=4, fake=True))
    assert "kv_replicated" in p["model.layers.0.self_attn.k_proj.weight"].tags
    k = "model.layers.*.self_attn.k_proj.weight"
    p = ml.plan(TINY, ml.shard({k: P("tp", None)}), ml.Mesh(tp=2, fake=True))
    assert p["model.layers.0.self_attn.k_proj.weight"].mesh_spec == P("tp")


def test_down_proj_alone_is_refused_in_and_out_of_regions():
    down = "model.layers.*.mlp.down_proj.weight"
    region = _llama_policy().without("layers.*.mlp.gate_proj", "layers.*.mlp.up_proj",
                                     "layers.*.mlp.down_proj")
    with _raises(ml.ConfigError, "gate_proj", "inside the", "region", "down_proj"):
        ml.plan(TINY, ml.shard(region, RULES) | ml.shard({down: P(None, "tp")}),
                ml.Mesh(tp=2, fake=True))
    outside = Policy("down only", modules=(ModuleRule("layers.*.mlp.down_proj", "rowwise"),),
                     regions=("layers.*.self_attn",))
    with _raises(ml.ConfigError, "mlp.down_proj: split over 'tp' on its input features",
                 "no column-parallel module", "P('tp', None)", "P()"):
        ml.plan(TINY, ml.shard(outside, RULES), ml.Mesh(tp=2, fake=True))
    # without regions the model runs on DTensors, which redistribute: it plans
    assert ml.plan(TINY, ml.shard({down: P(None, "tp")}), ml.Mesh(tp=2, fake=True)).runnable


# -- training entry points -------------------------------------------------------------------
def test_step_split_and_pipeline_batch_checks():
    from meshlab.train.step import _split
    from meshlab.transforms.pipeline._runtime import _pipeline_batch

    x = torch.zeros(4, 8, dtype=torch.long)
    for k, needle in [(2.5, "microbatches=2.5"), (0, "microbatches=0"), (True, "bool"),
                      (3, "local batch size 4 does not divide into 3")]:
        with _raises(ml.ConfigError, needle):
            _split({"input_ids": x}, k)
    with _raises(ml.ConfigError, "holds no samples"):
        _split(torch.tensor(3), 1)
    assert len(_split(x, 2)) == 2
    with _raises(ml.ConfigError, "pipeline(microbatches=3)", "input_ids has 4 rows",
                 "multiple of 3"):
        _pipeline_batch({"input_ids": x}, 3)
    with _raises(ml.ConfigError, "batch['input_ids']"):
        _pipeline_batch({"ids": x}, 2)
    assert _pipeline_batch({"input_ids": x}, 2)[0] is x


def test_step_pauses_the_garbage_collector_and_frees_the_cycles_it_made(one_process):
    import gc

    model = presets.build("tiny-llama", device="cpu", dtype=torch.float32)
    model.config.use_cache = False
    model = ml.parallelize(model, ml.remat("selective"), ml.Mesh(dp=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids}
    during = []
    model.model.layers[0].register_forward_hook(lambda *a: during.append(gc.isenabled()))
    ml.step(model, opt, batch)
    gc.collect()
    ml.step(model, opt, batch)
    assert during == [False, False] and gc.isenabled()
    assert gc.collect() == 0            # selective checkpointing's cycles already freed
    gc.disable()
    try:
        ml.step(model, opt, batch, pause_gc=False)
        assert during[-1] is False      # the caller's choice is kept
        assert gc.collect() > 0         # the step's cycles, left for the collector
    finally:
        gc.enable()
    ml.step(model, opt, batch, pause_gc=False)
    assert during[-1] is True
    with _raises(ml.ConfigError, "pause_gc=1"):
        ml.step(model, opt, batch, pause_gc=1)


def test_dataloader_distribute_shard_map_and_launcher_arguments():
    mesh = ml.Mesh(dp=2, tp=2, fake=True)
    data = list(range(16))
    for kw, err, needle in [(dict(batch_size=0), ml.ConfigError, "batch_size=0"),
                            (dict(batch_size=8.0), ml.ConfigError, "batch_size=8.0"),
                            (dict(batch_size=8, axes="dp"), ml.ConfigError, "axes='dp'"),
                            (dict(batch_size=8, shuffle=1), ml.ConfigError, "shuffle=1"),
                            (dict(batch_size=8, seed=-1), ml.ConfigError, "seed=-1")]:
        with _raises(err, needle):
            ml.dataloader(data, mesh, **kw)
    with _raises(ml.ConfigError, "map-style dataset"):
        ml.dataloader(3, mesh, 8)
    with _raises(ml.MeshError, "meshlab.Mesh"):
        ml.dataloader(data, {"dp": 2}, 8)
    with _raises(ml.ConfigError, "torch.Tensor"):
        ml.distribute([1, 2], mesh, P())
    with _raises(ml.RulesError, "rules="):
        ml.constrain(torch.zeros(2), P(), rules={"batch": "dp"})
    with _raises(ml.SpecError, "out_specs"):
        ml.shard_map(lambda x: x, P(), ["dp"])
    with _raises(ml.ConfigError, "fn must be a function"):
        ml.shard_map("f", P(), P())
    with _raises(ml.ConfigError, "nprocs=True"):
        ml.notebook_launcher(test_bad_argument_raises_a_typed_error_naming_it, nprocs=True)
    with _raises(ml.ConfigError, "timeout=0"):
        ml.notebook_launcher(test_bad_argument_raises_a_typed_error_naming_it, timeout=0)


def test_checkpoint_argument_types(tmp_path):
    model = torch.nn.Linear(2, 2)
    for call, needle in [(lambda: ml.checkpoint.save(3, model), "path=3"),
                         (lambda: ml.checkpoint.save(tmp_path, "model"), "nn.Module"),
                         (lambda: ml.checkpoint.save(tmp_path, model, extra=[1]), "extra=[1]"),
                         (lambda: ml.checkpoint.save(tmp_path, model, keep_last=0), "keep_last=0"),
                         (lambda: ml.checkpoint.save(tmp_path, model, optimizer=3), "optimizer"),
                         (lambda: ml.checkpoint.load(tmp_path, model, strict="no"), "strict='no'"),
                         (lambda: ml.checkpoint.load(tmp_path, model, timeout=-1), "timeout=-1")]:
        with _raises(ml.ConfigError, needle):
            call()
    assert not any(tmp_path.iterdir())                 # refused before anything is written


@pytest.mark.parametrize("argv,needle", [
    (["--batch", "-1"], "--batch -1"), (["--seq", "0", "--batch", "2"], "--seq 0"),
    (["--dtype", "int64"], "--dtype 'int64'"), (["--rules", "heads"], "--rules 'heads'"),
    (["--json", "/no/such/dir/p.json"], "does not exist"),
])
def test_cli_flags_fail_with_exit_code_2(argv, needle, capsys):
    from meshlab.cli import main

    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2"] + argv) == 2
    assert needle in capsys.readouterr().err


# -- on processes: refused before any collective, on every rank -----------------------------
def kv_mid_head_case(rank, world):
    """One KV head (of 8) split over tp=2: plan and parallelize refuse it alike."""
    spec = ml.shard({"model.layers.*.self_attn.k_proj.weight": P("tp", None)})
    with pytest.raises(ml.ConfigError) as planned:
        ml.plan(M.build("llama", num_key_value_heads=1), spec, ml.Mesh(tp=2, fake=True))
    with pytest.raises(ml.ConfigError) as ran:
        ml.parallelize(M.build("llama", num_key_value_heads=1), spec, ml.Mesh(tp=2))
    return str(planned.value), str(ran.value)


def microbatch_case(rank, world, pipelined):
    """A local batch of 4 into 3 microbatches: a ConfigError on every rank, no hang."""
    spec = ml.pipeline("pp", microbatches=3) if pipelined else ml.data_parallel("dp")
    mesh = ml.Mesh(pp=2) if pipelined else ml.Mesh(dp=2)
    model = ml.parallelize(M.build("llama", num_hidden_layers=2), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    batch = {"input_ids": torch.randint(0, 97, (4, 8), generator=torch.Generator().manual_seed(0))}
    with pytest.raises(ml.MeshlabError) as e:
        ml.step(model, opt, batch, microbatches=1 if pipelined else 3)
    ok = ml.step(model, opt, {"input_ids": batch["input_ids"][:3]},
                 microbatches=1) if pipelined else None     # the next step still runs
    return type(e.value).__name__, str(e.value), ok is None or math.isfinite(ok)


def test_kv_mid_head_refused_alike_on_two_ranks(world2):
    out = world2.run(kv_mid_head_case)
    assert all(planned == ran and "splits the 1 head " in ran for planned, ran in out), out


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipeline", "step"])
def test_microbatches_that_do_not_divide_raise_on_every_rank(world2, pipelined):
    out = world2.run(microbatch_case, pipelined=pipelined)
    for name, msg, ok in out:
        assert name == "ConfigError" and ("does not divide" in msg or "4 rows" in msg), out
        assert ok


def test_transform_json_round_trip_keeps_shard_specs():
    from meshlab.transforms._protocol import Transform

    s = ml.shard(ml.policies.auto, ml.Rules(mlp="tp"))
    assert Transform.from_json(s.to_json()) == s
    composed = s | ml.zero_shard(1)
    assert Transform.from_json(composed.to_json()) == composed


def test_entry_points_refuse_bad_arguments_typed():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ml.MeshlabError, match="takes a Plan"):
        ml.zero_shard(1)(3)
    with pytest.raises(ml.ConfigError, match="optimizer class"):
        ml.optimizer(model, torch.nn.Linear)
    with pytest.raises(ml.ConfigError, match="clip_grad_norm"):
        ml.optimizer(model, torch.optim.SGD, clip_grad_norm=-1.0)
    with pytest.raises(ml.ConfigError, match="seed"):
        ml.parallelize(model, ml.data_parallel("dp"), ml.Mesh(dp=2, fake=True), seed=1.5)
    with pytest.raises(ml.ConfigError, match="state_dict"):
        ml.parallelize(model, ml.data_parallel("dp"), ml.Mesh(dp=2, fake=True), state_dict=[1])


def test_glob_split_hf_attention_is_refused_at_plan_time():
    """Without the family's policy, glob specs would run HF attention on DTensors."""
    specs = {"model.layers.*.self_attn.q_proj.weight": P("tp", None),
             "model.layers.*.self_attn.o_proj.weight": P(None, "tp")}
    plan = ml.plan(M.build("llama"), ml.shard(specs), ml.Mesh(tp=2, fake=True))
    assert plan.not_runnable and "LlamaAttention" in plan.not_runnable[0]
    assert "policies.auto" in plan.not_runnable[0]


def test_init_weights_refuses_a_model_not_on_meta():
    """Values drawn when a model was built on the CPU are not the seed's: init_weights says
    so instead of handing the model back unchanged."""
    with pytest.raises(ml.ConfigError, match="holds no meta tensors.*torch.device\\('meta'\\)"):
        ml.init_weights(torch.nn.Linear(2, 2), seed=0)


class _ZeroBuffer(torch.nn.Module):
    """A module of one's own whose constructor fills a buffer (zeros) and has no
    initializer for it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("total", torch.zeros(3))


def test_init_weights_refuses_a_buffer_the_meta_device_emptied():
    """A buffer built on the meta device has no values; init_weights used to hand it back
    holding whatever memory ``to_empty`` gave it, and training read that. Now it names the
    buffer and the fix; a buffer built off the meta device keeps its constructor's values."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), _ZeroBuffer())
    with pytest.raises(ml.ConfigError, match="buffer '1.total' of _ZeroBuffer was built on "
                                             "the meta device.*reset_parameters"):
        ml.init_weights(model, seed=0)

    class Kept(_ZeroBuffer):
        def __init__(self):
            super().__init__()
            with torch.device("cpu"):
                self.register_buffer("total", torch.arange(3.0))
    with torch.device("meta"):
        kept = ml.init_weights(torch.nn.Sequential(Kept()), seed=0)
    assert torch.equal(kept[0].total, torch.arange(3.0))


def test_init_weights_sets_the_statistics_of_a_batch_norm_without_weights():
    """BatchNorm without affine weights has no parameters, so its reset was not called and
    its running variance and batch count were left as empty memory; they are now 1 and 0,
    as its constructor makes them."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, affine=False))
    ml.init_weights(model, seed=0)
    assert torch.equal(model[1].running_var, torch.ones(4))
    assert torch.equal(model[1].running_mean, torch.zeros(4))
    assert int(model[1].num_batches_tracked) == 0
