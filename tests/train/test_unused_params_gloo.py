"""Parameters without a gradient in a step, against one process, on 2 gloo ranks.

One process skips a parameter whose ``.grad`` is None: AdamW applies no weight decay and
no moment update to it and does not count the step; SGD's momentum does not move it. The
model here has a branch used on some steps only (``branch``: on the first step by every
sample, on the third by the first half of the batch, which is one data rank's), and a head
no step uses (``never``). Every layout must step exactly those parameters one process
steps: a parameter that no data rank has a gradient for is left alone (weights and
optimizer state), one that some rank has a gradient for is stepped on the sum, the
other ranks adding zeros.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(300)

BATCH = 8
# which samples use the branch, per step: all, none, the first half (one data rank's), none
USE = [(0, BATCH), (0, 0), (0, BATCH // 2), (0, 0)]
# used every step by some rank: the first, one rank's, the other's, the first's
SOME = [(0, BATCH), (0, BATCH // 2), (BATCH // 2, BATCH), (0, BATCH // 2)]
STEPS = len(USE)
TOL = dict(atol=1e-12, rtol=1e-10)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.never = nn.Linear(16, 4)
        self.out = nn.Linear(16, 4)

    def forward(self, x, m):
        h = torch.tanh(self.inp(x))
        if bool(m.any()):                 # the branch runs only where some sample asks
            h = h + m[:, None] * torch.tanh(self.branch(h))
        return self.out(h)


def _data(dtype, use=USE):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, BATCH, 8, generator=g).to(dtype)
    y = torch.randn(STEPS, BATCH, 4, generator=g).to(dtype)
    m = torch.zeros(STEPS, BATCH, dtype=dtype)
    for s, (a, b) in enumerate(use):
        m[s, a:b] = 1
    return x, y, m


def _base(dtype, frozen=False):
    torch.manual_seed(0)
    net = Net().to(dtype)
    if frozen:                            # the head no step uses, frozen by the user
        net.never.requires_grad_(False)
    return net


def _loss(out, b):
    return nn.functional.mse_loss(out, b["y"])


OPTS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1))}


def _reference(cls, kw, dtype, frozen=False, use=USE):
    x, y, m = _data(dtype, use)
    ref = _base(dtype, frozen)
    opt = cls([p for p in ref.parameters() if p.requires_grad], **kw)
    losses = []
    for s in range(STEPS):
        loss = nn.functional.mse_loss(ref(x[s], m[s]), y[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, ref, opt


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _layouts():
    import meshlab as ml
    from meshlab import P

    tp = ml.shard({"inp.weight": P("tp", None), "inp.bias": P("tp"),
                   "branch.weight": P(None, "tp"), "out.weight": P(None, "tp"),
                   "never.weight": P(None, "tp")})
    return {"dp": (ml.data_parallel("dp"), ml.Mesh(dp=2)),
            "dp-small-buckets": (ml.data_parallel("dp", bucket_mb=1e-5), ml.Mesh(dp=2)),
            "zero1": (ml.zero_shard(1, "dp"), ml.Mesh(dp=2)),
            "zero2": (ml.zero_shard(2, "dp"), ml.Mesh(dp=2)),
            "zero3": (ml.zero_shard(3, "dp"), ml.Mesh(dp=2)),
            "tp": (tp, ml.Mesh(tp=2)),
            "dp+offload": (ml.data_parallel("dp") | ml.offload(optimizer=1.0), ml.Mesh(dp=2)),
            "zero1+offload": (ml.zero_shard(1, "dp") | ml.offload(optimizer=1.0),
                              ml.Mesh(dp=2)),
            "zero3+offload": (ml.zero_shard(3, "dp") | ml.offload(params=1.0, grads=1.0,
                                                                    optimizer=1.0),
                              ml.Mesh(dp=2))}


def _train(spec, mesh, cls, kw, dtype, frozen=False, use=USE, **okw):
    import torch.distributed as dist

    import meshlab as ml

    x, y, m = _data(dtype, use)
    model = ml.parallelize(_base(dtype, frozen), spec, mesh)
    opt = ml.optimizer(model, cls, **kw, **okw)
    rt = model._meshlab
    r = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    mine = slice(r * BATCH // rt.dp_size, (r + 1) * BATCH // rt.dp_size)
    losses = [ml.step(model, opt, {"x": x[s, mine], "m": m[s, mine], "y": y[s, mine]},
                      _loss, inputs=["x", "m"]) for s in range(STEPS)]
    return losses, model, opt


def _same(_, oname, layouts, dtype=torch.float64, tol=TOL, frozen=False, use=USE, **okw):
    """Each of ``layouts`` trains as one process: losses and every weight; the parameters
    no step uses keep their initial values exactly."""
    cls, kw = OPTS[oname]
    want_losses, ref, _ = _reference(cls, kw, dtype, frozen, use)
    start = dict(_base(dtype).named_parameters())
    for lname in layouts:
        spec, mesh = _layouts()[lname]
        losses, model, _ = _train(spec, mesh, cls, kw, dtype, frozen, use, **okw)
        what = f"{lname}, {oname}"
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(want_losses, dtype=torch.float64), **tol,
                                   msg=lambda m: f"{what} losses: {m}")
        got = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(_full(got[n]).detach(), p.detach(), **tol,
                                       msg=lambda m, n=n: f"{what} {n}: {m}")
        for n in ("never.weight", "never.bias"):
            assert torch.equal(_full(got[n]).detach(), start[n].detach()), (what, n)


def case_replicated_and_tp(rank, world):
    """Data parallelism (one bucket, and a bucket per parameter, whose reductions a branch
    used by one rank once launched in a different order on each rank) and tensor
    parallelism by specs."""
    for oname in OPTS:
        _same(None, oname, ["dp", "dp-small-buckets", "tp"])
    return True


def case_zero1_whole(rank, world):
    """zero_shard(1) stepping whole parameters on their owners (any optimizer that is not
    elementwise, and AdamW or SGD with ``zero1_whole=True``): a parameter no rank has a
    gradient for is not stepped by its owner."""
    from meshlab.booster.nn.optimizer import Lamb

    for oname in OPTS:
        _same(None, oname, ["zero1"], zero1_whole=True)
    OPTS["lamb"] = (Lamb, dict(lr=2e-2, weight_decay=0.1))
    try:
        _same(None, "lamb", ["zero1"])
    finally:
        del OPTS["lamb"]
    return True


def case_zero1_flat(rank, world):
    """zero_shard(1) on flat slices: exact where every trainable parameter has a gradient
    on some rank each step (the branch used by one rank or both, the unused head frozen),
    the ranks without one adding zeros; a step in which a
    trainable parameter has no gradient on any rank is refused on every rank by name."""
    import meshlab as ml
    from meshlab.core.errors import ConfigError

    for oname in OPTS:
        _same(None, oname, ["zero1"], frozen=True, use=SOME)
    cls, kw = OPTS["adamw"]
    for lname in ("zero1", "zero1+offload"):
        spec, mesh = _layouts()[lname]
        with pytest.raises(ConfigError, match=r"never\.weight, never\.bias got no gradient "
                                              r"on any data rank.*zero1_whole=True"):
            _train(spec, mesh, cls, kw, torch.float64)
    with pytest.raises(ConfigError, match="zero1_whole=True.*not yet"):
        _train(*_layouts()["zero1+offload"], cls, kw, torch.float64, zero1_whole=True)
    del ml
    return True


def case_fsdp(rank, world):
    """zero_shard(2) and zero_shard(3), FSDP2: a branch one rank used no longer gives the
    ranks reduce-scatters of different sizes, and a parameter no rank used keeps no
    gradient (not stepped on zeros)."""
    for oname in OPTS:
        _same(None, oname, ["zero2", "zero3"])
    return True


def case_offload(rank, world):
    """offload beside data parallelism (host AdamW in float32: the updated weights to
    float32's rounding) and beside zero_shard(3) (FSDP2 keeps the shards on the host);
    the CPU AdamW runs its reference (torch's arithmetic, no C++ build)."""
    from meshlab.ops import _build

    with _build.force_reference():
        _offload()
    return True


def _offload():
    _same(None, "adamw", ["dp+offload"], tol=dict(atol=1e-6, rtol=1e-6))
    _same(None, "adamw", ["zero3+offload"])


def test_data_parallel_and_tensor_parallel_skip_unused_parameters(world2):
    assert world2.run(case_replicated_and_tp) == [True, True]


def test_zero1_whole_tensors_skip_unused_parameters(world2):
    assert world2.run(case_zero1_whole) == [True, True]


def test_zero1_flat_slices_exact_or_refused_by_name(world2):
    assert world2.run(case_zero1_flat) == [True, True]


def test_fsdp_skips_unused_parameters(world2):
    assert world2.run(case_fsdp, timeout=120) == [True, True]


def test_offload_skips_unused_parameters(world2):
    assert world2.run(case_offload) == [True, True]


