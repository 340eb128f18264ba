"""remat(..., offload=k): blocks' saved activations in host memory, on one process.

Against the same spec with the activations kept on the device (every spec here is itself
shown against one process by the composition table's cells): the same losses and weights,
bit for bit, with fused ops, some blocks checkpointed, under bf16 autocast and fp32, and
with each block's parameters stepped in the backward; the copies really leave (bytes
counted), come back ahead of their block's backward (none fetched late), are released with
the graph, and a tensor saved twice is copied once. Refused before anything runs: a count
of blocks it cannot take, another policy than 'full', and the rooms it is not yet shown
beside. (On CUDA the copies run on a stream of their own: ``test_offload_gpu.py``.)"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import meshlab as ml
from meshlab.policies import presets
from meshlab.transforms.remat import _offload

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_process")]


@pytest.fixture(scope="module")
def base():
    return ml.init_weights(presets.build("tiny-llama", num_hidden_layers=4), seed=0)


def _ids(seed):
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))


def _train(base, spec, cls=torch.optim.SGD, steps=3, **opt):
    model = ml.parallelize(copy.deepcopy(base), spec, ml.Mesh(dp=1))
    o = ml.optimizer(model, cls, lr=0.1, **opt)
    return model, [ml.step(model, o, {"input_ids": _ids(0)}) for _ in range(steps)]


SPECS = {"fuse": lambda r: ml.fuse() | r,
         "sib": lambda r: ml.fuse() | r | ml.step_in_backward(),
         "bf16": lambda r: ml.precision("bf16") | r,
         "fp32": lambda r: ml.precision("fp32") | r}


@pytest.mark.parametrize("case", list(SPECS))
def test_trains_bitwise_as_kept_on_the_device(base, made, case):
    opt = {"cls": torch.optim.AdamW} if case == "sib" else {}
    ref, ref_losses = _train(base, SPECS[case](ml.remat("full", count=1)), **opt)
    got, losses = _train(base, SPECS[case](ml.remat("full", count=1, offload=2)), **opt)
    assert losses == ref_losses and losses[-1] < losses[0]
    for (n, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), n
    (host,) = made
    assert host.offloaded == {1, 2}      # the first two of the blocks not checkpointed
    assert host.moved > 0 and host.late == 0 and not host.pending


def test_copies_leave_come_back_ahead_and_go_with_the_graph():
    """Blocks as plain modules: block 0 offloaded, its saved input copied once though two
    products save it, fetched by the hook on block 2's output (lead 2 of 3 blocks), and
    released with the graph; a forward without grad saves nothing."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x) * self.b(x)

    torch.manual_seed(0)
    blocks = [Twice() for _ in range(3)]
    ref_blocks = copy.deepcopy(blocks)
    host = _offload.HostActivations(3, {0}, lead=2)
    order = []
    fetch = host._fetch

    def logged(h):
        if h.dev is None:
            order.append("fetch")
        fetch(h)

    host._fetch = logged
    for i, b in enumerate(blocks):
        b.forward = host.wrap(i, b, b.forward)
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    y = x
    for i, b in enumerate(blocks):
        y = b(y)        # the backward enters block i when its output's gradient is made
        y.register_hook(lambda g, i=i: order.append(f"enter {i}"))
    y_ref = x_ref
    for b in ref_blocks:
        y_ref = b(y_ref)
    # block 0 saves its input (both products) and each product's output (the mul):
    # three tensors of 4 x 8 float32, its parameters kept
    assert host.moved == 3 * 4 * 8 * 4
    assert not host.pending                      # handed to block 2's output hook
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for b, r in zip(blocks, ref_blocks):
        for p, q in zip(b.parameters(), r.parameters()):
            assert torch.equal(p.grad, q.grad)
    # fetched on entering block 2's backward, ahead of blocks 1 and 0; none asked for late
    assert order == ["fetch"] * 3 + ["enter 2", "enter 1", "enter 0"] and host.late == 0

    with torch.no_grad():
        blocks[0](torch.randn(4, 8))
    assert host.moved == 3 * 4 * 8 * 4

    # a graph dropped without a backward takes its copies with it
    refs = []
    keep = host._pack

    def pack(t):
        out = keep(t)
        if isinstance(out, _offload._Held):
            refs.append(weakref.ref(out))
        return out

    host._pack = pack
    y = blocks[2](blocks[1](blocks[0](torch.randn(4, 8, requires_grad=True))))
    assert refs and all(r() is not None for r in refs)
    del y
    gc.collect()
    assert all(r() is None for r in refs)


def test_refused_before_anything_runs(base):
    with pytest.raises(ml.ConfigError, match="offload takes blocks remat\\('full'\\) leaves"):
        ml.remat("selective", offload=1)
    for bad in (-1, True, 1.5):
        with pytest.raises(ml.ConfigError, match="offload must be an int >= 0"):
            ml.remat("full", count=1, offload=bad)
    with pytest.raises(ml.ConfigError, match="give offload <= 1"):
        ml.plan(copy.deepcopy(base), ml.remat("full", count=3, offload=2), ml.Mesh(dp=1))
    with pytest.raises(ml.ConfigError, match="every= and count= choose"):
        ml.remat(lambda x: x, offload=1)
    # a room it is not yet shown beside: the composition table's refusal
    with pytest.raises(ml.ConfigError, match="remat\\(offload\\) x compile_blocks"):
        ml.plan(copy.deepcopy(base), ml.remat("full", count=1, offload=1)
                | ml.compile_blocks(), ml.Mesh(dp=1))
