"""precision('fp8') on one process: the install swaps every layer the plan chose, or says
which it could not."""

from __future__ import annotations

import types

import pytest
import torch

from tests import _models as M

pytest.importorskip("torchao.float8")


def _install(model, dropped=()):
    import meshlab as ml

    plan = ml.plan(M.build("llama"), ml.precision("fp8"), ml.Mesh(dp=1, fake=True))
    ctx = types.SimpleNamespace(model=model, plan=plan, dropped=set(dropped),
                                mesh=types.SimpleNamespace(device_type="cpu"))
    return plan.get(ml.transforms.Precision).install(ctx)


def test_every_chosen_layer_is_swapped():
    model = M.build("llama")
    _install(model)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert sum(k == "Float8Linear" for k in kinds.values()) == 14
    assert kinds["lm_head"] == "Linear"


def test_a_chosen_layer_another_room_replaced_is_refused_by_name():
    import meshlab as ml

    model = M.build("llama")
    model.model.layers[1].mlp.up_proj = torch.nn.Identity()
    with pytest.raises(ml.ConfigError, match=r"1 of the 14 .*model\.layers\.1\.mlp\.up_proj"):
        _install(model)


def test_the_blocks_another_stage_runs_are_not_counted():
    model = M.build("llama")
    model.model.layers[1] = torch.nn.Identity()        # a pipeline stage without block 1
    _install(model, dropped=("model.layers.1",))
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 7
