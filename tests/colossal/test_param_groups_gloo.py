"""Fine-tuning's parameter groups through the Booster, against one process.

Covers what every Colossal-AI fine-tuning example does (``examples/language/gpt/
hybridparallelism/finetune.py``, ``examples/tutorial/new_api/glue_bert/finetune.py``):
``AdamW`` over two groups, weights with weight decay and biases and norms without (here
also another learning rate), boosted under ZeRO-1 (``LowLevelZeroPlugin(stage=1)``),
ZeRO-3 (``TorchFSDPPlugin()``, ``GeminiPlugin``) and plain data parallelism; after three
steps every weight equals one process's AdamW over the same groups on the global batches
(float32, tight), and the inner optimizer holds the groups' options.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH = 3, 4          # BATCH samples per data rank


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and
                                                          "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0.0, "lr": 3e-2}]


def _plugin(name):
    from meshlab.booster.plugin import (GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin,
                                        TorchFSDPPlugin)

    return {"ddp": lambda: TorchDDPPlugin(),
            "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
            "zero3": lambda: TorchFSDPPlugin(),
            "gemini": lambda: GeminiPlugin(precision="fp32")}[name]()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def case_groups(rank, world, plugin):
    import torch.distributed as dist

    from meshlab.booster import Booster

    torch.manual_seed(0)
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    data = torch.randn(STEPS, world * BATCH, 8)
    target = torch.randn(STEPS, world * BATCH, 4)

    booster = Booster(plugin=_plugin(plugin))
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    model, opt, *_ = booster.boost(model, opt)
    groups = opt.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [g["lr"] for g in groups] == [1e-2, 3e-2]
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for s in range(STEPS):
        loss = nn.functional.mse_loss(model(data[s, mine]), target[s, mine])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()

    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    for s in range(STEPS):
        nn.functional.mse_loss(ref(data[s]), target[s]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = {n: _full(p).detach() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=1e-6, rtol=1e-5, msg=n)
    dist.barrier()


@pytest.mark.parametrize("plugin", ["ddp", "zero1", "zero3", "gemini"])
def test_two_groups_train_as_one_process(world2, plugin):
    world2.run(case_groups, plugin=plugin)


def test_a_group_of_no_parameter_of_the_model_is_refused():
    from meshlab.core.errors import ConfigError
    from meshlab.train._groups import group_layout

    m = Net()
    params = list(m.named_parameters())
    with pytest.raises(ConfigError, match="leave out trainable parameters"):
        group_layout(params, [{"params": [m.inp.weight]}])
    with pytest.raises(ConfigError, match="in groups 0 and 1"):
        group_layout(params, [{"params": list(m.parameters())}, {"params": [m.inp.bias]}])
    with pytest.raises(ConfigError, match="no trainable parameter"):
        group_layout(params, [{"params": [torch.nn.Parameter(torch.zeros(2))]}])
    got, options = group_layout(params, [{"params": ["inp.weight", "out.weight"], "lr": 1.0},
                                         {"params": ["inp.bias", "norm.weight", "norm.bias",
                                                     "out.bias"]}])
    assert options == [{"lr": 1.0}, {}] and got[id(m.inp.bias)] == 1
