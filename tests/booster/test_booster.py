"""The Booster facade without processes: the argument table walked argument by argument,
the documented table generated from it, plugin meshes, the optimizers' rebuild, and the
refusals (all raised before any process group is needed).
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

from meshlab.booster import (PLUGINS, Booster, CPUAdam, FusedAdam, GeminiPlugin, HybridAdam,
                             HybridParallelPlugin, LowLevelZeroPlugin, MoeHybridParallelPlugin,
                             NoEffectWarning, TorchDDPPlugin, TorchFSDPPlugin,
                             UnsupportedArgument)
from meshlab.booster._args import REQUIRED, is_default, probe_kwargs
from meshlab.booster._ckpt import METHODS, _args as method_args

from tests import REPO

ROOT = os.fspath(REPO)
BASE = {TorchDDPPlugin: {}, TorchFSDPPlugin: {}, LowLevelZeroPlugin: {}, GeminiPlugin: {},
        HybridParallelPlugin: dict(tp_size=2, pp_size=2, num_microbatches=4),
        MoeHybridParallelPlugin: dict(tp_size=2, pp_size=2, ep_size=2, num_microbatches=4)}
WORLD = 16


def _effect(plugin) -> tuple:
    """Everything a plugin decides: its stack (transforms and settings) and its mesh."""
    return repr(plugin.stack), list(plugin.mesh_shape(WORLD).items())


def _other(value):
    """A value other than the default, for an argument only its default is accepted for."""
    if value is None:
        return "something"
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}-other"


def _cases():
    for cls in PLUGINS:
        for a in cls.ARGS:
            yield pytest.param(cls, a, id=f"{cls.__name__}.{a.name}")


@pytest.mark.parametrize("cls,arg", list(_cases()))
def test_every_plugin_argument_is_implemented_refused_or_warned(cls, arg):
    base = BASE[cls]
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # the defaults never warn
        ref = cls(**base)
    if arg.default is REQUIRED:
        assert arg.name in base
        kw = {**base, **probe_kwargs(arg)}
        assert _effect(cls(**kw)) != _effect(ref), arg.name
        return
    if arg.kind == "default":
        with pytest.raises(UnsupportedArgument) as e:
            cls(**{**base, arg.name: _other(arg.default)})
        assert e.value.argument == arg.name and e.value.equivalent == arg.meshlab
        assert arg.name in str(e.value) and arg.meshlab in str(e.value)
        return
    kw = {**base, **probe_kwargs(arg)}
    assert not is_default(arg, kw[arg.name]), f"{arg.name}: the probe is the default"
    if arg.kind == "no_effect":
        with pytest.warns(NoEffectWarning, match=arg.name):
            p = cls(**kw)
        assert _effect(p) == _effect(cls(**{**kw, arg.name: arg.default})), arg.name
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoEffectWarning)   # a companion's own warning
        p = cls(**kw)
        companions = {k: v for k, v in kw.items() if k != arg.name}
        try:
            without = _effect(cls(**companions))
        except Exception:                            # the companions alone do not plan
            without = _effect(ref)
    assert _effect(p) != without, f"{cls.__name__}({arg.name}=...) changed nothing"


@pytest.mark.parametrize("name", list(METHODS))
def test_every_checkpoint_method_argument_is_handled(name):
    for a in METHODS[name]:
        if a.kind == "default":
            with pytest.raises(UnsupportedArgument, match=a.name):
                method_args(name, {a.name: _other(a.default)})
        elif a.kind == "no_effect":
            with pytest.warns(NoEffectWarning, match=a.name):
                method_args(name, probe_kwargs(a))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert method_args(name, probe_kwargs(a))[a.name] == probe_kwargs(a)[a.name]


def test_the_documented_table_is_the_generated_one():
    from meshlab.booster._table import generated_block, mapping_table

    page = os.path.join(ROOT, "docs", "booster.md")
    assert generated_block(page) == mapping_table(), (
        "docs/booster.md is out of date: python -m meshlab.booster.table docs/booster.md")
    table = mapping_table()
    for cls in PLUGINS:
        for a in cls.ARGS:
            assert f"| `{a.name}` |" in table.split(f"### {cls.__name__}\n")[1].split("###")[0]


def test_plugin_signatures_are_colossal_ais():
    sig = inspect.signature(HybridParallelPlugin)
    names = list(sig.parameters)
    assert names[:2] == ["tp_size", "pp_size"] and "dp_outside" in names
    assert sig.parameters["tp_size"].default is inspect.Parameter.empty
    assert inspect.signature(LowLevelZeroPlugin).parameters["initial_scale"].default == 2 ** 32
    assert list(inspect.signature(MoeHybridParallelPlugin).parameters)[:3] == [
        "tp_size", "pp_size", "ep_size"]
    assert HybridParallelPlugin(2, 1).tp_size == 2            # positional, and attributes


def test_unknown_and_missing_arguments_are_typed_errors():
    from meshlab import ConfigError

    with pytest.raises(TypeError, match="did you mean 'zero_stage'"):
        HybridParallelPlugin(tp_size=2, pp_size=1, zero_satge=1)
    with pytest.raises(TypeError, match="pp_size"):
        HybridParallelPlugin(tp_size=2)
    with pytest.raises(ConfigError, match="num_microbatches or microbatch_size"):
        HybridParallelPlugin(tp_size=1, pp_size=2)
    with pytest.raises(ConfigError, match="1 or 2"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(ConfigError, match="set enable_sequence_parallelism=True"):
        HybridParallelPlugin(tp_size=2, pp_size=1, sp_size=2)


def test_hybrid_shard_is_hybrid_sharding(monkeypatch):
    """torch FSDP's HYBRID_SHARD shards within a node and replicates across nodes:
    data_parallel('rep') | zero_shard(3, 'dp') on (nodes, LOCAL_WORLD_SIZE)."""
    from torch.distributed.fsdp import ShardingStrategy

    from meshlab import MeshError

    p = TorchFSDPPlugin(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    assert repr(p.spec) == "zero_shard(stage=0, axis='rep') | zero_shard(stage=3, axis='dp')"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert p.mesh_shape(4) == {"rep": 2, "dp": 2}
    z2 = TorchFSDPPlugin(sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2)
    assert "stage=2" in repr(z2.spec) and z2.mesh_shape(8) == {"rep": 4, "dp": 2}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(MeshError, match="LOCAL_WORLD_SIZE=3"):
        p.mesh_shape(4)
    assert TorchFSDPPlugin().mesh_shape(4) == {"dp": 4}


def test_meshes_follow_colossal_ais_axis_order():
    from meshlab import MeshError

    hp = HybridParallelPlugin(tp_size=2, pp_size=2, sp_size=2, enable_sequence_parallelism=True,
                              sequence_parallelism_mode="all_to_all", num_microbatches=2)
    assert hp.mesh_shape(32) == {"dp": 4, "pp": 2, "sp": 2, "tp": 2}
    inner = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2, dp_outside=False)
    assert list(inner.mesh_shape(8)) == ["pp", "dp", "tp"]
    moe = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=4)
    assert moe.mesh_shape(16) == {"dp": 4, "ep": 4}
    # ep before dp: the data axes dp x ep cannot be flattened on such a mesh (DeviceMesh
    # flattens in mesh order), so boost would stop with a KeyError; refused by name instead
    with pytest.raises(UnsupportedArgument, match="moe_dp_outside=False"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=4, moe_dp_outside=False)
    assert moe.stack.data_axes == ("dp", "ep")
    with pytest.raises(MeshError, match="multiple of 8"):
        HybridParallelPlugin(tp_size=4, pp_size=2, num_microbatches=2).mesh_shape(12)


def test_the_stacks_name_their_transforms():
    assert repr(TorchDDPPlugin(bucket_cap_mb=50).spec) == \
        "zero_shard(stage=0, axis='dp', bucket_mb=50.0)"
    g = GeminiPlugin(precision="bf16", offload_optim_frac=0.5, offload_param_frac=0.25, tp_size=2)
    s = repr(g.spec)
    assert s.startswith("shard(policies.auto)") and "zero_shard(stage=3" in s
    assert "offload(params=0.25, grads=0.25, optimizer=0.5" in s and "bfloat16" in s
    h = HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, num_microbatches=4,
                             enable_sequence_parallelism=True, precision="bf16",
                             gradient_checkpoint_config=__import__("meshlab").remat("full"))
    s = repr(h.spec)
    for piece in ("sequence('tp', mode='split_gather')", "zero_shard(stage=1",
                  "pipeline('pp', schedule='1f1b', microbatches=4", "remat('full')"):
        assert piece in s, (piece, s)
    z = LowLevelZeroPlugin(stage=2, cpu_offload=True, max_norm=1.0)
    assert "offload(params=0.0, grads=0.0, optimizer=1.0" in repr(z.spec)
    assert z.stack.clip_grad_norm == 1.0
    lo = LowLevelZeroPlugin(precision="fp16", initial_scale=2 ** 10, hysteresis=3)
    prec = lo.spec.parts[-1]
    assert (prec.init_scale, prec.hysteresis, prec.growth_interval) == (1024.0, 3, 1000)


def test_loss_scale_arguments_under_bf16_warn_instead_of_failing():
    with pytest.warns(NoEffectWarning, match="initial_scale"):
        HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16", initial_scale=1)


def test_booster_precision_is_composed_or_refused():
    from meshlab import ConfigError

    b = Booster(plugin=TorchDDPPlugin(), mixed_precision="bf16")
    assert "bfloat16" in repr(b.spec)
    with pytest.raises(ConfigError, match="sets the precision itself"):
        Booster(plugin=LowLevelZeroPlugin(precision="fp16"), mixed_precision="bf16")
    assert Booster(plugin=LowLevelZeroPlugin(precision="bf16"), mixed_precision="bf16")
    with pytest.raises(UnsupportedArgument, match="fp16_apex"):
        Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16_apex")
    fsdp = TorchFSDPPlugin(mixed_precision=torch.distributed.fsdp.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert "compute='bfloat16', reduce='float32'" in repr(Booster(plugin=fsdp).spec)


def test_plan_a_booster_layout_without_processes():
    """What boost will run on 64 ranks, planned on the meta device: the same transforms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    plugin = HybridParallelPlugin(tp_size=4, pp_size=2, zero_stage=1, precision="bf16",
                                  num_microbatches=8)
    booster = Booster(plugin=plugin)
    p = booster.plan(model, world_size=64)
    assert dict(p.mesh_shape) == {"dp": 8, "pp": 2, "tp": 4}
    assert not p.not_runnable
    want = [repr(t) for t in plugin.spec.parts]
    assert len(p.transforms) == len(want)
    assert all(got.startswith(w) for got, w in zip(p.transforms, want)), (p.transforms, want)
    assert p.memory().total > 0


def test_optimizers_rebuild_from_their_arguments():
    from meshlab.booster._optim import groups, recipe

    m = torch.nn.Linear(4, 4)
    cls, kw = recipe(HybridAdam(m.parameters(), lr=3e-4, weight_decay=0.1), m)
    assert cls is torch.optim.AdamW and kw == dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8,
                                                   weight_decay=0.1)
    cls, kw = recipe(CPUAdam(m.parameters(), adamw_mode=False), m)
    assert cls is torch.optim.Adam
    cls, kw = recipe(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m)
    assert cls is torch.optim.SGD and kw["momentum"] == 0.9 and kw["lr"] == 0.1
    for opt in (torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.1),
                torch.optim.Adam(m.parameters(), lr=2e-3), torch.optim.RMSprop(m.parameters())):
        cls, kw = recipe(opt, m)        # every kind rebuilds from what its group holds
        again = cls(m.parameters(), **kw)
        assert {k: again.param_groups[0][k] for k in kw} == kw
    with pytest.raises(UnsupportedArgument, match="bias_correction"):
        FusedAdam(m.parameters(), bias_correction=False)
    # several groups: each as its parameters' names and the options where it differs
    two = torch.optim.AdamW([{"params": [m.weight]}, {"params": [m.bias], "lr": 0.0}])
    cls, kw = recipe(two, m)
    assert groups(two, m, kw) == [{"params": ["weight"]}, {"params": ["bias"], "lr": 0.0}]
    # an Adam step of HybridAdam before boost is torch's (the same optimizer)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(m.state_dict())
    a, b = HybridAdam(m.parameters(), lr=0.1), torch.optim.AdamW(ref.parameters(), lr=0.1,
                                                                 weight_decay=0.0)
    for mod, opt in ((m, a), (ref, b)):
        mod(torch.ones(2, 4)).sum().backward()
        opt.step()
    torch.testing.assert_close(m.weight, ref.weight, atol=0, rtol=0)


def test_an_optimizer_over_other_parameters_is_refused_before_boost_runs():
    """boost rebuilds the optimizer over the model's parameters. An optimizer built over
    another model (Colossal-AI's ``test_lora`` builds one so), or holding a parameter the
    model lacks (a learnable loss), would then train what it was not built over and leave
    what it was built over as it is: refused by name, before any process group is needed;
    one that leaves out some of the model's trainable parameters too."""
    from meshlab import ConfigError

    m, other, temp = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Parameter(torch.ones(()))
    booster = Booster(plugin=TorchDDPPlugin())
    with pytest.raises(ConfigError, match=r"holds none of the model's parameters \(it was "
                                          r"built over another model\?\).*model.parameters\(\)"):
        booster.boost(m, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"holds 1 parameters that are not the model's "
                                          r"\(shapes \[\(\)\]\)"):
        booster.boost(m, torch.optim.SGD([*m.parameters(), temp], lr=0.1))
    with pytest.raises(ConfigError, match=r"leaves out trainable parameters \['bias'\]"):
        booster.boost(m, torch.optim.SGD([m.weight], lr=0.1))
    m.bias.requires_grad_(False)            # a frozen parameter left out is not trained
    from meshlab.booster._optim import recipe

    assert recipe(torch.optim.SGD([m.weight], lr=0.1), m)[0] is torch.optim.SGD


def test_scheduler_follows_the_rebuilt_optimizer():
    from meshlab.booster._optim import rebind_scheduler

    m = torch.nn.Linear(2, 2)
    old = torch.optim.AdamW(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(old, lambda s: 0.5 ** s)
    old.step()
    sched.step()
    new = torch.optim.AdamW(m.parameters(), lr=123.0)
    rebind_scheduler(sched, old, new, [0])
    assert new.param_groups[0]["lr"] == 0.5 and new.param_groups[0]["initial_lr"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # no "step() before optimizer.step()"
        new.step()
        sched.step()
    assert new.param_groups[0]["lr"] == 0.25


def test_launch_without_a_launcher_names_the_fix(monkeypatch):
    import torch.distributed as dist

    from meshlab import ConfigError
    from meshlab.booster import launch_from_torch

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        launch_from_torch()


def test_readme_booster_example_is_true():
    import doctest
    import re

    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```python\n(>>> from meshlab\.booster import .*?)```", text, re.S).group(1)
    test = doctest.DocTestParser().get_doctest(block, {}, "README", "README.md", 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0 and runner.tries >= 2


def test_use_fp8_is_precision_fp8():
    """Colossal-AI's use_fp8 (its float8 linear layers, with bf16) is precision('fp8'); with
    fp16 it is refused by name. Expert parallelism beside it plans (the composition table's
    expert_route x precision('fp8') composes), and so does tensor parallelism (shard x
    precision('fp8'))."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import meshlab as ml

    moe = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="bf16",
                                  use_fp8=True)
    for plugin in (LowLevelZeroPlugin(stage=2, precision="bf16", use_fp8=True),
                   GeminiPlugin(precision="bf16", use_fp8=True),
                   HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16", use_fp8=True),
                   moe):
        prec = next(t for t in plugin.spec.parts if isinstance(t, ml.transforms.Precision))
        assert prec.float8 == "tensorwise" and prec.compute == "bfloat16", plugin
    from tests import _models as M

    assert ml.plan(M.build("qwen3_moe"), moe.spec, ml.Mesh(dp=2, ep=2, fake=True)).runnable
    with pytest.raises(UnsupportedArgument, match="use_fp8=True.*bf16 compute only"):
        LowLevelZeroPlugin(stage=1, precision="fp16", use_fp8=True).spec
    with pytest.raises(UnsupportedArgument, match="use_fp8=True"):
        HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp8")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tp = HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16", use_fp8=True)
    assert ml.plan(model, tp.spec, ml.Mesh(dp=2, tp=2, fake=True)).runnable


def test_shardformer_switches_route_what_the_model_has():
    """Colossal-AI's ``enable_fused_normalization`` / ``enable_all_optimization`` apply
    what a family supports (its policies pick FusedLayerNorm for BERT): on BERT (LayerNorm,
    a head with a bias) and on a mixture of experts (no gated MLP) the plugins' spec plans,
    routing what the model has and naming in the plan what it left, where fuse() refused
    both before."""
    import meshlab as ml
    from meshlab.booster.plugin import GeminiPlugin, HybridParallelPlugin
    from meshlab.transforms.fuse import FuseLeft

    from tests import _models as M

    plugin = GeminiPlugin(tp_size=2, enable_fused_normalization=True)
    plan = ml.plan(M.build("bert"), plugin.spec, ml.Mesh(dp=1, tp=2, fake=True))
    assert plan.runnable
    assert [op for op, _ in plan.decision(FuseLeft).left] == ["rms_norm"]
    plugin = HybridParallelPlugin(tp_size=1, pp_size=1, enable_all_optimization=True)
    plan = ml.plan(M.build("qwen3_moe"), plugin.spec, ml.Mesh(dp=2, fake=True))
    fuse = next(t for t in plan.rooms if t.kind == "fuse")
    assert fuse.routed(plan) == ("rms_norm", "rotary", "attention")
    assert [op for op, _ in plan.decision(FuseLeft).left] == ["mlp"]


def test_pipeline_options_without_a_pipeline_warn_and_interleaving_needs_chunks():
    """``pp_style``, ``num_model_chunks`` and ``num_layers_per_stage`` with pp_size=1 were
    accepted without a word (``num_microbatches`` warned); an interleaved schedule of one
    chunk per stage ran, where Colossal-AI asserts more than one."""
    with pytest.warns(NoEffectWarning, match="pp_style='interleaved', num_model_chunks=2.*"
                                             "no effect with pp_size=1"):
        HybridParallelPlugin(tp_size=1, pp_size=1, pp_style="interleaved", num_model_chunks=2)
    with pytest.warns(NoEffectWarning, match=r"num_layers_per_stage=\[1, 1\]"):
        HybridParallelPlugin(tp_size=1, pp_size=1, num_layers_per_stage=[1, 1])
    from meshlab.core.errors import ConfigError

    with pytest.raises(ConfigError, match="num_model_chunks > 1"):
        HybridParallelPlugin(tp_size=1, pp_size=2, pp_style="interleaved", num_model_chunks=1,
                             num_microbatches=2)
