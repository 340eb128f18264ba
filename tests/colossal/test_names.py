"""Colossal-AI's names a script imports, each a thin delegate, on one process.

Covers ``tests/test_booster/test_accelerator.py`` (the accelerator places a model),
``tests/test_checkpoint_io/test_general_checkpoint_io.py`` (``GeneralCheckpointIO``: an
unsharded file ``torch.load`` reads, sharded directories with their index, sharded
optimizer state, several parameter groups, a scheduler round trip — compared exactly, where
Colossal-AI's ``check_state_dict_equal`` allows 1e-3), and the names the four examples
import (``launch_from_slurm``/``launch_from_openmpi``'s environments,
``get_accelerator``, ``DistCoordinator``, ``LazyInitContext``, ``set_seed``,
``CosineAnnealingWarmupLR``, ``get_dist_logger``, the mixed-precision objects and
``GradientCheckpointConfig``).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

from tests.colossal._compare import equal_state


def test_the_accelerator_places_a_model_on_this_machines_device():
    from meshlab.booster.accelerator import Accelerator, get_accelerator
    from meshlab.core.errors import ConfigError

    acc = get_accelerator()
    device = acc.get_current_device()
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    model = Accelerator(device.type).configure_model(nn.Linear(8, 8))
    assert next(model.parameters()).device.type == device.type
    acc.empty_cache(); acc.synchronize(); acc.reset_peak_memory_stats()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            Accelerator("cuda")
    with pytest.raises(ConfigError, match="'cuda' or 'cpu'"):
        Accelerator("tpu")


def _trained(seed=0, groups=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    params = ([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 2e-3}]
              if groups else model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def _fresh(groups=False):
    model, _ = _trained(seed=1, groups=groups)
    params = ([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 2e-3}]
              if groups else model.parameters())
    return model, torch.optim.Adam(params, lr=1e-3)


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_an_unsharded_checkpoint_is_a_file_torch_load_reads(tmp_path, use_safetensors):
    from meshlab.booster.checkpoint_io import GeneralCheckpointIO
    from meshlab.booster.nn.lr_scheduler import CosineAnnealingWarmupLR

    model, opt = _trained()
    sched = CosineAnnealingWarmupLR(opt, total_steps=10)
    sched.step()
    io = GeneralCheckpointIO()
    path = tmp_path / ("model.safetensors" if use_safetensors else "model.bin")
    io.save_model(model, path, use_safetensors=use_safetensors)
    io.save_optimizer(opt, tmp_path / "optim")
    io.save_lr_scheduler(sched, tmp_path / "sched")
    io._sync_d2h(); io._sync_io()
    assert path.is_file()
    if not use_safetensors:
        equal_state(torch.load(path, weights_only=True), model.state_dict())
    new, new_opt = _fresh()
    new_sched = CosineAnnealingWarmupLR(new_opt, total_steps=10)
    io.load_model(new, path)
    io.load_optimizer(new_opt, tmp_path / "optim")
    io.load_lr_scheduler(new_sched, tmp_path / "sched")
    equal_state(new.state_dict(), model.state_dict())
    equal_state(new_opt.state_dict(), opt.state_dict())          # betas stay a tuple
    assert new_sched.state_dict() == sched.state_dict()


@pytest.mark.parametrize("use_async", [True, False])
def test_an_optimizer_under_a_safetensors_name_is_a_safetensors_file(tmp_path, use_async):
    """``test_unsharded_checkpoint`` saves the optimizer to ``*.safetensors`` with
    ``use_async=True`` and loads it back: a safetensors file (the state's tensors by
    ``state.<index>.<name>``, the rest JSON in its metadata), as Colossal-AI's loader and
    torch.load tell a file by that name, read back exactly (betas a tuple again)."""
    from safetensors import safe_open

    from meshlab.booster.checkpoint_io import GeneralCheckpointIO
    from meshlab.core.errors import ConfigError

    model, opt = _trained(groups=True)
    io = GeneralCheckpointIO()
    path = tmp_path / "optim.safetensors"
    io.save_optimizer(opt, path, use_async=use_async)
    io._sync_d2h(); io._sync_io()
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert keys == {f"state.{i}.{k}" for i, st in opt.state_dict()["state"].items()
                    for k in st}
    assert json.loads(meta["param_groups"])[1]["lr"] == 2e-3
    new, new_opt = _fresh(groups=True)
    io.load_optimizer(new_opt, path)
    equal_state(new_opt.state_dict(), opt.state_dict())
    # Colossal-AI's own file of this name holds pickles; meshlab does not unpickle them
    from safetensors.torch import save_file

    save_file({"state.0.exp_avg": torch.zeros(2), "param_groups": torch.zeros(3, dtype=torch.uint8)},
              str(tmp_path / "theirs.safetensors"),
              metadata={"format": "pt", "non_tensor_keys": '["param_groups"]'})
    with pytest.raises(ConfigError, match="save it again with meshlab"):
        io.load_optimizer(new_opt, tmp_path / "theirs.safetensors")


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_a_sharded_checkpoint_is_shards_of_size_per_shard_with_an_index(tmp_path,
                                                                        use_safetensors):
    from meshlab.booster.checkpoint_io import GeneralCheckpointIO

    model, opt = _trained()
    io = GeneralCheckpointIO()
    # size_per_shard in MB; 0 puts each tensor in a shard of its own
    io.save_model(model, tmp_path / "m", True, True, "pre", 0, use_safetensors=use_safetensors)
    index = [f for f in os.listdir(tmp_path / "m") if f.endswith(".index.json")]
    assert index and index[0].startswith("pre-")
    with open(tmp_path / "m" / index[0]) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) == len(model.state_dict()) and all(f.startswith("pre-") for f in files)
    io.save_optimizer(opt, tmp_path / "o", shard=True, size_per_shard=0)
    new, new_opt = _fresh()
    io.load_model(new, str(tmp_path / "m"), strict=True)
    io.load_optimizer(new_opt, str(tmp_path / "o"))
    equal_state(new.state_dict(), model.state_dict())
    equal_state(new_opt.state_dict(), opt.state_dict())


def test_sharded_optimizer_state_of_several_groups_round_trips(tmp_path):
    from meshlab.booster.checkpoint_io import GeneralCheckpointIO

    model, opt = _trained(groups=True)
    io = GeneralCheckpointIO()
    io.save_optimizer(opt, tmp_path / "o", shard=True, size_per_shard=10)
    new, new_opt = _fresh(groups=True)
    io.load_optimizer(new_opt, str(tmp_path / "o"))
    equal_state(new_opt.state_dict(), opt.state_dict())
    assert [g["lr"] for g in new_opt.param_groups] == [1e-3, 2e-3]


def test_a_sharded_hugging_face_checkpoint_loads_with_from_pretrained(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshlab.booster.checkpoint_io import GeneralCheckpointIO

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    GeneralCheckpointIO().save_model(model, tmp_path / "hf", shard=True, size_per_shard=1)
    again = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    equal_state(again.state_dict(), model.state_dict())


def _colossal_cosine_warmup(t, total, warmup, base, eta_min=0.0):
    """Colossal-AI's CosineAnnealingWarmupLR at step t, written out from its definition."""
    if t < warmup:
        return (t + 1) / warmup * base
    span = total - warmup
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * (t - warmup) / span)) / 2


def test_schedulers_are_torch_schedulers_with_colossal_ais_values():
    from meshlab.booster.nn.lr_scheduler import (CosineAnnealingWarmupLR, LinearWarmupLR,
                                                 MultiStepWarmupLR)
    from meshlab.core.errors import ConfigError

    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    s = CosineAnnealingWarmupLR(opt, total_steps=12, warmup_steps=3, eta_min=0.01)
    assert isinstance(s, torch.optim.lr_scheduler.LRScheduler)
    for t in range(12):
        assert math.isclose(opt.param_groups[0]["lr"], _colossal_cosine_warmup(t, 12, 3, 0.5,
                                                                                0.01))
        opt.step()
        s.step()
    opt = torch.optim.SGD([p], lr=1.0)
    s = LinearWarmupLR(opt, total_steps=10, warmup_steps=4)
    got = []
    for _ in range(10):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    assert got[:4] == [0.2, 0.4, 0.6, 0.8] and math.isclose(got[4], 1.0) and \
        math.isclose(got[9], 1 / 6)
    opt = torch.optim.SGD([p], lr=1.0)
    s = MultiStepWarmupLR(opt, total_steps=10, warmup_steps=2, milestones=[4], gamma=0.5)
    got = []
    for _ in range(6):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    assert got == [0.5, 1.0, 1.0, 1.0, 0.5, 0.5]
    with pytest.raises(ConfigError, match="warmup_steps <= total_steps"):
        CosineAnnealingWarmupLR(opt, total_steps=2, warmup_steps=3)


def test_the_small_names(capsys):
    from meshlab.booster.cluster import DistCoordinator
    from meshlab.booster.lazy import LazyInitContext
    from meshlab.booster.logging import get_dist_logger
    from meshlab.booster.mixed_precision import (FP16TorchMixedPrecision, BF16MixedPrecision,
                                                 FP16ApexMixedPrecision, mixed_precision_factory)
    from meshlab.booster.shardformer import GradientCheckpointConfig
    from meshlab.booster.utils import get_current_device, set_seed
    from meshlab.booster import UnsupportedArgument
    from meshlab.core.errors import ConfigError

    c = DistCoordinator()
    assert c.is_master() and c.world_size == 1 and c.rank == 0
    c.print_on_master("hello")
    assert "hello" in capsys.readouterr().out
    assert c.on_master_only()(lambda: 7)() == 7
    with LazyInitContext():
        lazy = nn.Linear(3, 3)
    assert lazy.weight.is_meta
    LazyInitContext.materialize(lazy)
    assert not lazy.weight.is_meta and lazy.weight.device == get_current_device()
    set_seed(3)
    a = torch.rand(2)
    set_seed(3)
    assert torch.equal(a, torch.rand(2))
    log = get_dist_logger()
    assert log.logger is get_dist_logger().logger
    log.info("x", ranks=[0])
    fp16 = FP16TorchMixedPrecision(init_scale=1024, growth_interval=10)
    assert (fp16.precision.compute, fp16.precision.loss_scale) == ("float16", "dynamic")
    assert BF16MixedPrecision().precision.compute == "bfloat16"
    assert isinstance(mixed_precision_factory("fp16"), FP16TorchMixedPrecision)
    with pytest.raises(UnsupportedArgument, match="apex"):
        FP16ApexMixedPrecision()
    with pytest.raises(ConfigError, match="fraction"):
        GradientCheckpointConfig(gradient_checkpointing_ratio=2.0)


@pytest.mark.parametrize("launcher,env", [
    ("launch_from_slurm", {"SLURM_PROCID": "0", "SLURM_NPROCS": "1", "SLURM_LOCALID": "0"}),
    ("launch_from_openmpi", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "0"}),
])
def test_the_launchers_read_their_environment(monkeypatch, one_process, launcher, env):
    import socket

    import torch.distributed as dist

    import meshlab.booster as colossalai
    from meshlab.core.errors import ConfigError

    for k in ("SLURM_PROCID", "SLURM_NPROCS", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="not set"):
        getattr(colossalai, launcher)(host="127.0.0.1", port=29500)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    getattr(colossalai, launcher)(host="127.0.0.1", port=port, verbose=False)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0


def test_launch_refuses_nccl_without_cuda():
    import meshlab.booster as colossalai
    from meshlab.core.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="backend='gloo'"):
        colossalai.launch(rank=0, world_size=1, host="localhost", port=29500, backend="nccl")
