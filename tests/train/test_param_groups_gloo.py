"""Two parameter groups (weights with decay at one learning rate, biases and norms without
at another) through ``meshlab.optimizer(param_groups=...)`` under tensor parallelism by
specs, ZeRO-1 and ZeRO-3, and each of those and data parallelism with the optimizer
offloaded (the CPU AdamW steps each group's host tensors with that group's options), on 2
gloo ranks: after three AdamW steps every weight equals one process's AdamW over the same
groups on the global batches (float32, 1e-6). A group option the CPU AdamW does not
compute (``amsgrad``) is refused by name. The Booster's plugins are
covered by ``tests/colossal/test_param_groups_gloo.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH = 3, 8          # BATCH: the global batch


from tests.colossal.test_param_groups_gloo import Net  # noqa: E402  (the same small model)

DECAY = ["inp.weight", "out.weight"]
REST = ["inp.bias", "norm.weight", "norm.bias", "out.bias"]


def _groups(by_name):
    return [{"params": [by_name(n) for n in DECAY], "weight_decay": 0.1},
            {"params": [by_name(n) for n in REST], "weight_decay": 0.0, "lr": 3e-2}]


def _layout(name):
    import meshlab as ml
    from meshlab import P

    tp = ml.shard({"inp.weight": P("tp", None), "inp.bias": P("tp"),
                   "out.weight": P(None, "tp")})
    return {"tp": (tp, ml.Mesh(tp=2), False),
            "zero1": (ml.zero_shard(1, "dp"), ml.Mesh(dp=2), True),
            "zero3": (ml.zero_shard(3, "dp"), ml.Mesh(dp=2), True),
            # the CPU AdamW steps the host part of each group with that group's options,
            # the device optimizer the rest (half of the optimizer on the host)
            "dp_offload": (ml.data_parallel("dp") | ml.offload(optimizer=0.5), ml.Mesh(dp=2),
                           True),
            "zero1_offload": (ml.zero_shard(1, "dp") | ml.offload(optimizer=1.0),
                              ml.Mesh(dp=2), True),
            "zero3_offload": (ml.zero_shard(3, "dp") | ml.offload(params=1.0, grads=1.0, optimizer=1.0),
                              ml.Mesh(dp=2), True),
            "tp_offload": (tp | ml.offload(optimizer=1.0), ml.Mesh(tp=2), False)}[name]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def case_layouts(rank, world):
    import meshlab as ml
    from meshlab.core.errors import ConfigError

    torch.manual_seed(0)
    base = Net()
    data, target = torch.randn(STEPS, BATCH, 8), torch.randn(STEPS, BATCH, 4)
    ref = Net()
    ref.load_state_dict(base.state_dict())
    ref_opt = torch.optim.AdamW(_groups(dict(ref.named_parameters()).get), lr=1e-2)
    for s in range(STEPS):
        nn.functional.mse_loss(ref(data[s]), target[s]).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    for name in ("tp", "zero1", "zero3", "dp_offload", "zero1_offload", "zero3_offload",
                 "tp_offload"):
        spec, mesh, split = _layout(name)
        model = Net()
        model.load_state_dict(base.state_dict())
        model = ml.parallelize(model, spec, mesh)
        opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2,
                           param_groups=_groups(lambda n: n))
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-2], name
        mine = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2) if split else slice(None)
        for s in range(STEPS):
            nn.functional.mse_loss(model(data[s, mine]), target[s, mine]).backward()
            opt.step()
            opt.zero_grad()
        got = {n: _full(p).detach() for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), atol=1e-6, rtol=1e-5,
                                       msg=f"{name}: {n}")

    model = ml.parallelize(Net(), ml.zero_shard(1, "dp") | ml.offload(optimizer=1.0),
                           ml.Mesh(dp=2))
    amsgrad = _groups(lambda n: n)
    amsgrad[1]["amsgrad"] = True
    with pytest.raises(ConfigError, match="parameter group 1 sets amsgrad"):
        ml.optimizer(model, torch.optim.AdamW, lr=1e-2, param_groups=amsgrad)
    return True


def test_two_groups_train_as_one_process(world2):
    assert world2.run(case_layouts) == [True, True]
