"""``meshlab.optimizer``'s step on torch's fused multi-tensor kernels, on one process.

The unscale and overflow check run as the loss scaler's one fused kernel per device and
dtype, the global norm as ``torch.nn.utils.get_total_norm`` per group of gradients split
alike, the clipping as ``clip_grads_with_norm_``: on 200 parameter tensors under fp16
and clipping a step reads the host at most twice (the overflow flag and the norm) where
the per-tensor loop read it once per gradient, and trains as that loop did (norm within
1e-6, weights within fp32 rounding). Step hooks register and remove as torch's do.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import meshlab as ml
from meshlab.train.optimizer import MeshOptimizer

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_process")]


class _Deep(nn.Module):
    """100 linear layers: 200 parameter tensors."""

    def __init__(self, width: int = 8, depth: int = 100) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class _Before(MeshOptimizer):
    """The step as it was: a ``mul_`` per gradient, then a per-tensor finiteness check,
    the norm accumulated in float64 copies, clipping by a coefficient read on the host."""

    def _unscale(self, items):
        inv = 1.0 / self.scaler.scale
        for g, _ in items:
            g.mul_(inv)
        flag = torch.zeros(1)
        for g, _ in items:
            if not torch.isfinite(g).all():
                flag.fill_(1.0)
                break
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        overflow = bool(flag.item())
        self.scaler.update(overflow)
        if overflow:
            self.zero_grad()
        return not overflow

    def _global_norm(self, items):
        total = torch.zeros((), dtype=torch.float64)
        for g, _ in items:
            total += g.detach().double().pow(2).sum()
        return total.sqrt()

    def _clip(self, items, norm):
        coef = self.clip / (float(norm) + 1e-6)
        if coef < 1.0:
            for g, _ in items:
                g.mul_(coef)


class _Reads(TorchDispatchMode):
    """Counts the host reads of tensor values (``aten._local_scalar_dense``)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _uncounted(inner) -> None:
    """Leave torch's own update out of the count: on the CPU, AdamW's single-tensor path
    reads each parameter's step counter (``_get_value``), which on CUDA (foreach or fused)
    it does not; what is counted is meshlab's part of the step."""
    from torch.utils._python_dispatch import _disable_current_modes

    step = inner.step

    def quiet(*a, **k):
        with _disable_current_modes():
            return step(*a, **k)

    inner.step = quiet


def _model(seed: int = 0):
    torch.manual_seed(seed)
    base = _Deep()
    return ml.parallelize(base, ml.precision("fp16", init_scale=2.0 ** 6), ml.Mesh(dp=1))


def _backward(model, opt, x, blow_up: bool = False):
    loss = model(x).pow(2).mean() * 1e-2
    opt.scale(loss).backward()
    if blow_up:
        next(model.parameters()).grad[0, 0] = float("inf")


def _train(cls, steps: int = 4, clip: float = 0.05, inf_at: int | None = None):
    model = _model()
    opt = cls(model, torch.optim.AdamW, lr=1e-2, clip_grad_norm=clip, check_replicas=0)
    _uncounted(opt.inner)
    reads, norms, taken = [], [], []
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        _backward(model, opt, x, blow_up=i == inf_at)
        with _Reads() as r:
            taken.append(opt.step())
        opt.zero_grad()
        reads.append(r.n)
        norms.append(opt.last_grad_norm)
    return model, opt, reads, norms, taken


def test_at_most_two_host_reads_per_step_and_the_same_training_as_before():
    model, opt, reads, norms, taken = _train(MeshOptimizer, inf_at=2)
    ref, ref_opt, ref_reads, ref_norms, ref_taken = _train(_Before, inf_at=2)
    assert sum(p.numel() > 0 for p in model.parameters()) == 200
    assert max(reads) <= 2, reads
    # the loop read the host per gradient (it stops at the first inf on the overflow step)
    assert min(r for r, ok in zip(ref_reads, ref_taken) if ok) >= 100, ref_reads
    assert taken == ref_taken == [True, True, False, True]
    assert opt.scaler.scale == ref_opt.scaler.scale == 2.0 ** 5     # 2 ** 6, halved once
    for got, want in zip(norms, ref_norms):
        assert math.isclose(got, want, rel_tol=1e-6), (got, want)
    assert min(n for n in norms if n is not None) > 0.05           # every step clipped
    for (n, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=n)


def test_unclipped_steps_are_identical_to_before():
    model, *_ = _train(MeshOptimizer, clip=1e9)
    ref, *_ = _train(_Before, clip=1e9)
    for (n, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


def test_the_norm_is_fp64s_within_1e6_and_makes_no_fp64_copy():
    model = _model()
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1, nonfinite="skip", check_replicas=0)
    model(torch.randn(16, 8)).pow(2).sum().backward()
    want = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    seen = set()

    class _Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                seen.add(out.dtype)
            return out

    with _Dtypes():
        got = opt.grad_norm()
    assert math.isclose(got, want, rel_tol=1e-6), (got, want)
    assert torch.float64 not in seen, seen


def test_a_float64_models_norm_is_float64():
    """It was float32, and clipping a float64 model was off one process's by 1e-10."""
    model = _model().double()
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1, nonfinite="skip", check_replicas=0)
    model(torch.randn(16, 8, dtype=torch.float64)).pow(2).sum().backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert math.isclose(opt.grad_norm(), float(want), rel_tol=1e-15)


def test_a_low_precision_gradients_norm_is_accumulated_in_fp32():
    from meshlab.train.optimizer import _norm

    gs = [torch.randn(1000, generator=torch.Generator().manual_seed(i)).bfloat16() * 100
          for i in range(3)]
    want = math.sqrt(sum(g.double().pow(2).sum().item() for g in gs))
    got = _norm(gs, torch.float32)
    assert got.dtype == torch.float32
    assert math.isclose(float(got), want, rel_tol=1e-6)
    # torch's own would round each norm to bfloat16 (about 3 significant digits)
    assert torch.nn.utils.get_total_norm(gs).dtype == torch.bfloat16


def test_step_hooks_register_run_and_remove():
    model = _model()
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1, check_replicas=0)
    calls = []
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    post = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    _backward(model, opt, torch.randn(2, 8))
    opt.step()
    assert calls == ["pre", "post"]
    pre.remove()
    post.remove()
    opt.zero_grad()
    _backward(model, opt, torch.randn(2, 8))
    opt.step()
    assert calls == ["pre", "post"]
    h = opt.register_state_dict_pre_hook(lambda o: None)
    h.remove()
    h = opt.register_load_state_dict_post_hook(lambda o: None)
    h.remove()



def test_a_parameter_unfrozen_after_the_optimizer_is_built_is_refused():
    """torch's optimizer over ``model.parameters()`` trains a frozen parameter once it is
    unfrozen; ``meshlab.optimizer`` holds the parameters trainable when it was built, so a
    step after ``requires_grad_(True)`` would leave the unfrozen one as it is: refused by
    name, before the step changes anything."""
    torch.manual_seed(0)
    base = _Deep(depth=3)
    base.layers[0].weight.requires_grad_(False)
    model = ml.parallelize(base, ml.precision("fp32"), ml.Mesh(dp=1))
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1, check_replicas=0)
    model.layers[0].weight.requires_grad_(True)
    model(torch.randn(2, 8)).pow(2).mean().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ml.ConfigError, match=r"\['layers.0.weight'\] became trainable after "
                                             r"the optimizer was built"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    model.layers[0].weight.requires_grad_(False)      # frozen again: the step runs
    assert opt.step() is True
    assert not torch.equal(model.layers[1].weight, before["layers.1.weight"])
