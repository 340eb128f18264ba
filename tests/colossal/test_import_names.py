"""Colossal-AI names its own tests and examples import, beyond the Booster's surface.

* ``PipelineGraph`` (``examples/language/llama/benchmark.py`` imports it at the top and
  builds it for ``--pp_style zbv``): accepted with its arguments; ``get_v_schedule()``
  refuses with ``UnsupportedArgument`` naming the plugin arguments of meshlab's zbv.
* ``ColoParameter`` (``tests/test_booster/test_plugin/test_gemini_plugin.py`` asserts every
  parameter of a model boosted with ``GeminiPlugin`` is one): a parameter holding a DTensor.
* ``clear_layout_converter`` (``tests/test_checkpoint_io/test_hybrid_parallel_plugin_checkpoint_io.py``
  calls it between cases): nothing to clear.
* ``HybridParallelModule`` (``tests/test_lora/test_lora.py`` unwraps ``model.module.module``
  when the boosted model is one): meshlab's boosted model never is, so the model is kept.
* ``shardformer.layer.utils.Randomizer`` (the same checkpoint test calls
  ``Randomizer.reset_index()`` between cases): nothing to reset; the hand-sharded layers of
  ``shardformer.layer`` (``Linear1D_Col``, imported by the model zoo's ``simple_mlp``) raise
  an ``ImportError`` naming meshlab's way (a weight's partition spec).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_pipeline_graph_is_built_and_its_schedule_refused_with_the_plugin_fix():
    from meshlab.booster import UnsupportedArgument
    from meshlab.booster.pipeline.schedule.v_schedule import PipelineGraph
    from meshlab.core.errors import ConfigError

    hidden, heads, length = 64, 4, 64               # the benchmark's cost model for zbv
    mem_f = 34 * hidden + 5 * heads * length
    mem_w = -32 * hidden
    graph = PipelineGraph(n_stage=2, n_micro=4, f_cost=1000, b_cost=1000, w_cost=1000,
                          c_cost=1, f_mem=mem_f * 1.5, b_mem=(-mem_w - mem_f) * 1.5,
                          w_mem=mem_w * 1.5)
    with pytest.raises(UnsupportedArgument) as e:
        graph.get_v_schedule()
    assert e.value.argument == "scheduler_nodes"
    assert "pp_style='zbv'" in e.value.equivalent and "pp_size=2" in e.value.equivalent
    with pytest.raises(ConfigError):
        PipelineGraph(n_stage=0, n_micro=4, f_cost=1, b_cost=1, w_cost=1, c_cost=1,
                      f_mem=1, b_mem=1, w_mem=1)


def test_a_plain_model_is_not_a_hybrid_parallel_module_and_none_is_made():
    from meshlab.booster.plugin import HybridParallelPlugin
    from meshlab.booster.plugin.hybrid_parallel_plugin import (
        HybridParallelModule, HybridParallelPlugin as FromModule)
    from meshlab.core.errors import ConfigError

    assert FromModule is HybridParallelPlugin
    model = nn.Linear(2, 2)
    kept = model.module.module if isinstance(model, HybridParallelModule) else model
    assert kept is model
    with pytest.raises(ConfigError):
        HybridParallelModule(model)


def test_clear_layout_converter_returns():
    from meshlab.booster.tensor.d_tensor.api import clear_layout_converter

    assert clear_layout_converter() is None


def test_boosted_gemini_parameters_are_colo_parameters_and_plain_ones_are_not(one_process):
    from meshlab.booster import Booster, launch
    from meshlab.booster.plugin import GeminiPlugin
    from meshlab.booster.tensor import ColoParameter
    from meshlab.booster.tensor.colo_parameter import ColoParameter as FromModule
    from meshlab.core.errors import ConfigError

    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    launch(rank=0, world_size=1, host="localhost", port=port, verbose=False)
    assert FromModule is ColoParameter
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert not any(isinstance(p, ColoParameter) for p in model.parameters())
    assert not isinstance(torch.zeros(2), ColoParameter)
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    model, optimizer, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    names = [n for n, p in model.named_parameters() if not isinstance(p, ColoParameter)]
    assert names == [], names
    loss = model(torch.randn(3, 8)).mean()
    booster.backward(loss, optimizer)
    optimizer.step()
    assert all(isinstance(p, ColoParameter) for p in model.parameters())
    with pytest.raises(ConfigError):
        ColoParameter(torch.zeros(2))


def test_lazy_init_takes_this_process_device_and_refuses_another():
    """``examples/language/llama/benchmark.py`` and ColossalChat's ``lora_finetune.py``
    build the model in ``LazyInitContext(default_device=get_current_device())``."""
    from meshlab.booster.lazy import LazyInitContext
    from meshlab.booster.utils import get_current_device
    from meshlab.core.errors import ConfigError

    here = get_current_device()
    for device in (here, str(here), here.type):
        with LazyInitContext(default_device=device):
            layer = nn.Linear(4, 4)
        assert layer.weight.is_meta
    LazyInitContext.materialize(layer)
    assert layer.weight.device.type == here.type and not layer.weight.is_meta
    other = "cuda:7" if here.type == "cpu" else "cpu"
    with pytest.raises(ConfigError, match="this process's device"):
        LazyInitContext(default_device=other)
    with pytest.raises(ConfigError):
        LazyInitContext(default_device="not-a-device")


def test_randomizer_resets_and_the_hand_sharded_layers_name_the_fix():
    from meshlab.booster.shardformer.layer.utils import Randomizer

    assert Randomizer.reset_index() is None and Randomizer.increment_index() is None
    with pytest.raises(ImportError, match="partition spec"):
        from meshlab.booster.shardformer.layer import Linear1D_Col  # noqa: F401
