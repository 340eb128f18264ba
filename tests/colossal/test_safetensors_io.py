"""Colossal-AI's background safetensors writers and pinned state dicts.

Re-written from Colossal-AI's ``tests/test_checkpoint_io/test_safetensors_async_io.py``
(``test_create_pin``, ``test_save_load``): the same state dicts (three 1024 x 1024 Adam
states and 62 parameter indices in one group; three model weights), the same calls and
the same checks, compared exactly. Pinned memory needs an accelerator: those cases run on
a GPU, and on the CPU the call is refused by name.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from meshlab.booster.checkpoint_io.utils import create_pinned_state_dict
from meshlab.booster.utils import get_current_device
from meshlab.booster.utils.safetensors import load_flat, move_and_save, save, save_nested
from meshlab.core.errors import ConfigError

from tests.colossal._compare import equal_state

_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _optim_state():
    return {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.rand(1024, 1024),
                          "exp_avg_sq": torch.rand(1024, 1024)} for i in range(3)},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08,
                              "weight_decay": 0, "bias_correction": True,
                              "params": list(range(62))}]}


def _model_state():
    return {f"module.weight{i}": torch.rand(1024, 1024) for i in range(3)}


def _written(writer):
    writer.sync_before_step()
    writer.synchronize()


def test_save_load(tmp_path):
    state = _optim_state()
    path = tmp_path / "save_optimizer.safetensors"
    _written(save_nested(path, state))
    equal_state(load_flat(path), state)

    shard = tmp_path / "save_optimizer_shard.safetensors"       # the state alone, a shard
    _written(save_nested(shard, state["state"]))
    equal_state(load_flat(shard), state["state"])

    model = _model_state()
    path = tmp_path / "save_model.safetensors"
    _written(save(path, model))
    equal_state(load_file(path), model)

    # move_and_save from the device (this machine's: the CPU here), without pinned buffers
    on_device = {k: v.to(get_current_device()) for k, v in model.items()}
    path = tmp_path / "save_model_device.safetensors"
    _written(move_and_save(path, on_device))
    equal_state(load_file(path), model)


def test_numbers_beside_tensors_come_back_as_written(tmp_path):
    state = {"state": {0: {"step": 7, "momentum_buffer": torch.ones(3)}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "nesterov": False,
                               "params": [0], "name": "decay"}]}
    path = tmp_path / "o.safetensors"
    _written(save_nested(path, state))
    equal_state(load_flat(path), state)


def test_a_pickled_file_is_refused(tmp_path):
    """Colossal-AI's save_nested pickles the param groups into a byte tensor and lists it
    under ``non_tensor_keys``: meshlab reads no pickles."""
    from safetensors.torch import save_file

    path = str(tmp_path / "colossal.safetensors")
    save_file({"state-0-exp_avg": torch.ones(2), "param_groups": torch.zeros(8, dtype=torch.uint8)},
              path, metadata={"format": "pt", "non_tensor_keys": json.dumps(["param_groups"])})
    with pytest.raises(ConfigError, match="pickles .* meshlab never unpickles"):
        load_flat(path)


def test_a_failed_write_raises_and_leaves_no_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "model.safetensors"          # a directory that is a file
    w = save(path, _model_state())
    with pytest.raises(ConfigError, match="writing .* failed"):
        w.synchronize()
    assert not os.path.exists(path)
    with pytest.raises(ConfigError, match="'x' is not a tensor"):
        save(tmp_path / "m.safetensors", {"x": 1.0})


@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine can pin memory")
def test_pinning_without_an_accelerator_is_refused():
    with pytest.raises(ConfigError, match="pinned host memory needs an accelerator"):
        create_pinned_state_dict(_model_state())


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("empty", [True, False])
@pytest.mark.parametrize("num_threads", [1, 4])
def test_create_pin(empty, num_threads):
    model = _model_state()
    pinned = create_pinned_state_dict(model, empty=empty, num_threads=num_threads)
    for k in model:
        assert pinned[k].is_pinned()
        if not empty:
            assert torch.equal(pinned[k], model[k])
    optim = _optim_state()
    pinned = create_pinned_state_dict(optim, empty=empty, num_threads=num_threads)
    for idx, st in optim["state"].items():
        for k, v in st.items():
            assert pinned["state"][idx][k].is_pinned()
            if not empty:
                assert torch.equal(pinned["state"][idx][k], v)
    assert pinned["param_groups"] == optim["param_groups"]


@pytest.mark.gpu
@_GPU
def test_move_and_save_through_pinned_buffers(tmp_path):
    model = _model_state()
    on_device = {k: v.cuda() for k, v in model.items()}
    # zeros: the file holds the weights only if they were copied into the buffers
    pinned = {k: torch.zeros_like(v).pin_memory() for k, v in model.items()}
    path = tmp_path / "save_model_cuda.safetensors"
    _written(move_and_save(path, on_device, pinned))
    equal_state(load_file(path), model)
