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


def test_the_swap_keeps_every_hook_and_refuses_a_replaced_forward():
    """The swap builds new modules: the hooks installed on the old ones (forward ones, as
    tensor-parallel regions install, but also a full backward hook and a state-dict hook)
    and meshlab's marks go along; a forward replaced on the instance is refused by name
    (the new module would not run it)."""
    import meshlab as ml
    from meshlab.transforms.precision._float8 import Float8Layers, convert

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append("pre"))
    model[0].register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    model[0].register_state_dict_post_hook(lambda m, sd, p, lv: seen.append("state_dict"))
    model[0]._meshlab_mark = 7
    assert convert(model, Float8Layers("tensorwise", ("0",))) == 1
    assert type(model[0]).__name__ == "Float8Linear" and model[0]._meshlab_mark == 7
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(16, 32, requires_grad=True)).sum().backward()
    model.state_dict()
    assert seen == ["pre", "backward", "state_dict"], seen

    other = torch.nn.Sequential(torch.nn.Linear(32, 32))
    other[0].forward = lambda x: x
    with pytest.raises(ml.ConfigError, match="forward was replaced on the instance"):
        convert(other, Float8Layers("tensorwise", ("0",)))


def test_projections_fuse_computes_as_one_product_are_swapped_each_with_its_own():
    """fuse's decoder layers compute the query, key and value products in one call of the
    query projection (instance forwards on the three maps). The float8 swap gives each map
    its own forward back and swaps it: the model computes what a model swapped before fuse
    routed it computes, where it was refused as a replaced forward before."""
    import copy

    import meshlab as ml
    from meshlab.transforms._install import restore_forward
    from meshlab.transforms.fuse import fuse_model

    a = ml.init_weights(M.build("llama"), seed=0)
    b = copy.deepcopy(a)
    fuse_model(a)
    attn = a.model.layers[0].self_attn
    assert all("forward" in vars(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj"))
    _install(a)
    _install(b)
    fuse_model(b)           # float8 maps are not plain ones: no shared product here
    for m in (a, b):
        attn = m.model.layers[0].self_attn
        for n in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(attn, n)
            assert type(proj).__name__ == "Float8Linear" and "forward" not in vars(proj)
            assert not restore_forward(proj)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        la, lb = a(input_ids=ids).logits, b(input_ids=ids).logits
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
