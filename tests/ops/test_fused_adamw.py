"""FusedAdamW on the CPU: the same parameters and state as torch.optim.AdamW over several
steps (C++ kernel and reference paths), state dicts moving both ways, the options it
refuses, the path it records, DTensor parameters on two gloo ranks, and the Triton kernel
and its host-side tables run by Triton's interpreter (only where Triton is installed)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from meshlab import ConfigError
from meshlab.ops import FusedAdamW, _build

NATIVE = shutil.which(os.environ.get("CXX", "c++")) is not None and \
    os.environ.get("MESHLAB_OPS_NATIVE", "1") != "0"
KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# 70_000 elements cross the kernels' work chunks; the rest are odd sizes, a 0-d tensor and
# an empty one.
SHAPES = [(70_000,), (37, 11), (3,), (), (5, 7), (4,), (0, 3)]
NO_GRAD = 5          # SHAPES[5] never gets a gradient
LATE = 4             # SHAPES[4] gets its first gradient at step 3


def _params(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _groups(ps):
    # Two groups with their own lr and weight decay.
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-2, "weight_decay": 0.0}]


def _set_grads(step: int, gen: torch.Generator, *param_lists) -> None:
    for i, ps in enumerate(zip(*param_lists)):
        if i == NO_GRAD or (i == LATE and step < 2):
            for p in ps:
                p.grad = None
            continue
        g = torch.randn(ps[0].shape, generator=gen).to(ps[0].dtype)
        for p in ps:
            p.grad = g.clone()


def _assert_same(opt_a, a, opt_b, b, tol=1e-6) -> None:
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=tol, atol=tol)
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=tol, atol=tol)


@pytest.mark.parametrize("force_reference", [False, True])
def test_matches_torch_adamw(force_reference):
    a, b = _params(0), _params(0)
    oa, ob = FusedAdamW(_groups(a), **KW), torch.optim.AdamW(_groups(b), **KW)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        _set_grads(step, gen, a, b)
        if force_reference:
            with _build.force_reference():
                oa.step()
        else:
            oa.step()
        ob.step()
        native = NATIVE and not force_reference
        assert oa.native is native, oa.fallback_reason
        path = _build.LAST_PATH[("fused_adamw", "cpu")]
        assert path.native is native
        if native:
            assert path.reason == "C++ kernel (csrc/cpu_adam.cpp)" and oa.fallback_reason is None
        elif force_reference:
            assert "force_reference" in path.reason == oa.fallback_reason
    for i, (pa, p0) in enumerate(zip(a, _params(0))):
        assert torch.equal(pa.detach(), p0.detach()) is (i == NO_GRAD or pa.numel() == 0)
    _assert_same(oa, a, ob, b)
    assert oa.state[a[0]]["step"].item() == 5 and oa.state[a[LATE]]["step"].item() == 3
    assert not oa.state.get(a[NO_GRAD]), "a parameter without a gradient gets no state"


def test_state_dict_moves_both_ways():
    a, b = _params(0), _params(0)
    oa, ob = FusedAdamW(_groups(a), **KW), torch.optim.AdamW(_groups(b), **KW)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        _set_grads(step, gen, a, b)
        oa.step()
        ob.step()
    sa, sb = oa.state_dict(), ob.state_dict()
    # One layout: the same group keys and values, per-param keys, dtypes and devices.
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for key, t in sa["state"][k].items():
            u = sb["state"][k][key]
            assert (t.dtype, t.device, t.shape) == (u.dtype, u.device, u.shape), (k, key)
    # Cross over: torch continues from FusedAdamW's state and FusedAdamW from torch's.
    c, d = [copy.deepcopy(p) for p in a], [copy.deepcopy(p) for p in b]
    oc = torch.optim.AdamW(_groups(c), **KW)
    oc.load_state_dict(copy.deepcopy(sa))
    od = FusedAdamW(_groups(d), **KW)
    od.load_state_dict(copy.deepcopy(sb))
    for step in range(3, 5):
        _set_grads(step, gen, a, b, c, d)
        for opt in (oa, ob, oc, od):
            opt.step()
    _assert_same(oa, a, oc, c)
    _assert_same(ob, b, od, d)
    _assert_same(oa, a, ob, b)
    assert od.state[d[0]]["step"].item() == 5


def test_loaded_step_becomes_a_float32_cpu_tensor():
    # A step saved in another form (a float64 tensor here; a CUDA tensor from torch's fused
    # or capturable modes) is stored as FusedAdamW counts: a float32 CPU scalar.
    a = _params(0)[:2]
    opt = FusedAdamW(a, **KW)
    sd = {"state": {0: {"step": torch.tensor(4.0, dtype=torch.float64),
                        "exp_avg": torch.zeros(70_000), "exp_avg_sq": torch.zeros(70_000)}},
          "param_groups": [dict(opt.param_groups[0], params=[0, 1])]}
    opt.load_state_dict(sd)
    step = opt.state[a[0]]["step"]
    assert (step.dtype, step.device.type, step.item()) == (torch.float32, "cpu", 4.0)
    for p in a:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[a[0]]["step"].item() == 5 and opt.state[a[1]]["step"].item() == 1


def test_refuses_what_it_does_not_implement():
    ps = _params(0)[:2]
    with pytest.raises(ConfigError, match="amsgrad"):
        FusedAdamW(ps, amsgrad=True)
    with pytest.raises(ConfigError, match="maximize"):
        FusedAdamW(ps, maximize=True)
    with pytest.raises(ConfigError, match="lr, eps, weight_decay"):
        FusedAdamW(ps, lr=-1.0)
    opt = FusedAdamW(ps[:1])
    with pytest.raises(ConfigError, match="amsgrad"):
        opt.add_param_group({"params": ps[1:], "amsgrad": True})
    # A state dict saved with amsgrad is refused before anything changes.
    ref = torch.optim.AdamW(ps[:1], amsgrad=True)
    ps[0].grad = torch.ones_like(ps[0])
    ref.step()
    before = opt.state_dict()
    with pytest.raises(ConfigError, match="amsgrad"):
        opt.load_state_dict(ref.state_dict())
    assert opt.state_dict() == before
    # ConfigError is a ValueError, as torch's own argument checks raise.
    with pytest.raises(ValueError):
        FusedAdamW(ps, maximize=True)


@pytest.mark.parametrize("force_reference", [False, True])
def test_sparse_and_mismatched_gradients_raise(force_reference):
    p, q = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))
    opt = FusedAdamW([p, q])
    p.grad, q.grad = torch.randn(4, 3), torch.randn(5)
    opt.step()
    before = p.detach().clone(), q.detach().clone()
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="SparseAdam"), \
            (_build.force_reference() if force_reference else contextlib.nullcontext()):
        opt.step()
    # Refused before anything changed: no parameter moved, no step was counted.
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])
    assert opt.state[p]["step"].item() == opt.state[q]["step"].item() == 1
    if not hasattr(p, "grad_dtype"):
        return                               # torch before grad_dtype: no such gradient
    p.grad_dtype = None                      # lets a gradient of another dtype be assigned
    p.grad = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"p.grad.to\(p.dtype\)"):
        opt.step()


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: only the reference exists")
def test_fallbacks_are_recorded_and_match():
    # float64 has no kernel; a non-contiguous gradient takes the reference for its param
    # only; both equal torch.optim.AdamW.
    torch.manual_seed(0)
    shapes = [(8, 6), (9,)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    a.append(torch.nn.Parameter(torch.randn(5, dtype=torch.float64)))
    b = [copy.deepcopy(p) for p in a]
    oa, ob = FusedAdamW(a, **KW), torch.optim.AdamW(b, **KW)
    for _ in range(3):
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape[::-1], dtype=pa.dtype).t() if pa.dim() == 2 \
                else torch.randn(pa.shape, dtype=pa.dtype)
            pa.grad, pb.grad = g, g.clone()
        oa.step()
        ob.step()
        assert not oa.native and oa.fallback_reason in ("no C++ kernel for float64",
                                                        "gradient not contiguous")
        assert _build.LAST_PATH[("fused_adamw", "cpu")].reason == oa.fallback_reason
    _assert_same(oa, a, ob, b)
    # Contiguous float32 only: the kernel again.
    a32 = [torch.nn.Parameter(torch.randn(6))]
    o32 = FusedAdamW(a32)
    a32[0].grad = torch.randn(6)
    o32.step()
    assert o32.native and _build.LAST_PATH[("fused_adamw", "cpu")].native


def test_state_replaced_between_steps_is_picked_up():
    # The cached plan must notice state swapped under it (here: cleared for one param).
    a, b = _params(0)[:3], _params(0)[:3]
    oa, ob = FusedAdamW(a, **KW), torch.optim.AdamW(b, **KW)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        for pa, pb in zip(a, b):
            pa.grad = torch.randn(pa.shape, generator=gen)
            pb.grad = pa.grad.clone()
        if step == 2:
            oa.state.pop(a[1])
            ob.state.pop(b[1])
        oa.step()
        ob.step()
    _assert_same(oa, a, ob, b)
    assert oa.state[a[1]]["step"].item() == 2


# ---------------------------------------------------------------------------- DTensor

def case_dtensor_matches_torch(rank, world):
    """FusedAdamW over DTensor parameters (sharded, unevenly sharded, replicated) equals
    torch.optim.AdamW over the same DTensors, and keeps DTensor state in AdamW's layout."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from meshlab.ops import FusedAdamW

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = [torch.randn(64, 8), torch.randn(7, 3), torch.randn(5)]
    layouts = [[Shard(0)], [Shard(1)], [Replicate()]]
    a = [torch.nn.Parameter(distribute_tensor(t, mesh, pl)) for t, pl in zip(full, layouts)]
    b = [torch.nn.Parameter(distribute_tensor(t, mesh, pl)) for t, pl in zip(full, layouts)]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    oa, ob = FusedAdamW(a, **kw), torch.optim.AdamW(b, **kw)
    for _ in range(3):
        for pa, pb, t, pl in zip(a, b, full, layouts):
            g = distribute_tensor(torch.randn(t.shape), mesh, pl)
            pa.grad, pb.grad = g, copy.deepcopy(g)
        oa.step()
        ob.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa.full_tensor(), pb.full_tensor(), rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            sa, sb = oa.state[pa][key], ob.state[pb][key]
            assert isinstance(sa, DTensor) and sa.placements == pa.placements
            torch.testing.assert_close(sa.full_tensor(), sb.full_tensor(), rtol=1e-6, atol=1e-7)
        assert oa.state[pa]["step"].item() == 3
    torch.optim.AdamW(b, **kw).load_state_dict(copy.deepcopy(oa.state_dict()))
    return oa.native


def test_dtensor_parameters(world2):
    native = world2.run(case_dtensor_matches_torch)
    assert native[0] == native[1] == NATIVE


# ---------------------------------------------------------------------------- Triton

_INTERPRETED = textwrap.dedent(r"""
    import torch
    from meshlab.ops import FusedAdamW, _build, fused_adamw
    from meshlab.ops import _triton_adamw as T
    from meshlab.ops.cpu_adam import adamw_reference

    # 1. The launcher over sizes that are not multiples of the block (2048) or the chunk
    #    (65536), fp32 and bf16, against the reference computed in float32.
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3)
    shapes = [(70_001,), (37, 11), (3,), (), (2048,), (0,), (4099,)]
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        mk = lambda scale=1.0, f=torch.randn: [(f(s, generator=gen) * scale).to(dtype)
                                               for s in shapes]
        ps, gs, ms, vs = mk(), mk(), mk(0.1), mk(0.01, torch.rand)
        want = [[t.float() for t in col] for col in (ps, gs, ms, vs)]
        T.adamw_step(ps, gs, ms, vs, **kw)
        for p, g, m, v in zip(*want):
            adamw_reference(p, g, m, v, **kw)
        for got, exp in zip(ps + ms + vs, want[0] + want[2] + want[3]):
            if dtype == torch.float32:
                torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)
            else:
                # One rounding to bf16 of the float32 result. (The interpreter truncates
                # float32 -> bf16 where CUDA rounds to nearest: at most one bf16 ulp.)
                torch.testing.assert_close(got.float(), exp, rtol=2 ** -7, atol=1e-6)

    # 2. FusedAdamW's Triton path (cached tables, gradient addresses re-uploaded when they
    #    change, one launch per step count, unaligned views) on CPU tensors, fp32, against
    #    torch.optim.AdamW.
    fused_adamw.KERNEL_FOR_DEVICE["cpu"] = "triton"
    launches = []
    launch = T.launch
    T.launch = lambda *a, **k: (launches.append(k["aligned"]), launch(*a, **k))
    gen = torch.Generator().manual_seed(1)
    inits = [torch.randn(s, generator=gen) for s in [(4099,), (37, 11), (), (70,)]]
    a = [torch.nn.Parameter(t.clone()) for t in inits]
    b = [torch.nn.Parameter(t.clone()) for t in inits]
    # A view at an odd element offset of a buffer: addresses not 16-byte aligned.
    buf = torch.zeros(301)
    buf[1:] = torch.randn(300, generator=gen)
    a.append(torch.nn.Parameter(buf[1:].view(20, 15)))
    b.append(torch.nn.Parameter(buf[1:].view(20, 15).clone()))
    okw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    oa = FusedAdamW(a[:4], **okw)
    oa.add_param_group({"params": a[4:], "lr": 2e-2})
    ob = torch.optim.AdamW([{"params": b[:4]}, {"params": b[4:], "lr": 2e-2}], **okw)
    for step in range(4):
        for i, (pa, pb) in enumerate(zip(a, b)):
            if i == 3 and step == 0:      # a later first step: two step counts in one group
                pa.grad = pb.grad = None
                continue
            pa.grad = torch.randn(pa.shape, generator=gen)   # new addresses every step
            pb.grad = pa.grad.clone()
        oa.step()
        ob.step()
        assert oa.native and oa.fallback_reason is None, oa.fallback_reason
        assert _build.LAST_PATH[("fused_adamw", "cpu")].reason.startswith("Triton")
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(oa.state[pa][key], ob.state[pb][key], rtol=1e-6, atol=1e-6)
    # Group 0: one launch at step 0, then two a step (a[3] is one step behind); the
    # unaligned group 1: one a step, through the kernel's unaligned specialization.
    assert launches.count(True) == 1 + 2 * 3 and launches.count(False) == 4, launches
    tables = oa._plans[0].buckets[0].tables
    assert sorted(tables, key=len) == [(3,), (0, 1, 2)], tables.keys()
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True,
                         env=env, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), \
        out.stdout[-3000:] + out.stderr[-6000:]
