"""Fused ops on the CPU: opcheck, numerics against the references in float32 and bfloat16
(outputs and gradients), the C++ path actually taken, the fallback giving the same numbers,
DTensor inputs sharded across two gloo ranks, and CPUAdamW against torch.optim.AdamW."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from meshlab.ops import check as _check
from meshlab.ops import OPS, _build

# Ops with their own kernels (linear_cross_entropy's is its softmax step between matmuls).
KERNEL_OPS = ("geglu", "layer_norm", "linear_cross_entropy", "rms_norm", "rotary", "swiglu")
NATIVE = shutil.which(os.environ.get("CXX", "c++")) is not None and \
    os.environ.get("MESHLAB_OPS_NATIVE", "1") != "0"


def _grads(fn, args, grad_idx, gout=None):
    leaves = [a.detach().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    out = fn(*leaves)
    gout = torch.randn_like(out) if gout is None else gout
    return (out, *torch.autograd.grad(out, [leaves[i] for i in grad_idx], gout)), gout


@pytest.fixture(scope="module", autouse=True)
def built():
    # Build once up front so a build failure shows as one clear error, not in every test.
    _build.build_all()                    # both extensions, side by side
    mod = _build.ops_cpu()
    if NATIVE:
        assert mod is not None, f"C++ kernels failed to build: {_build.failure('meshlab_ops_cpu')}"
    return mod


def test_import_builds_nothing():
    code = ("import meshlab, meshlab.ops, sys; from meshlab.ops import _build; "
            "assert not _build._MODULES and not _build._FAILED and not _build.LAST_PATH; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("op", sorted(OPS))
def test_opcheck(op):
    row = _check.check_op(op, "cpu", dtypes=("float32", "bfloat16"), small=True)
    assert row.opcheck == "pass", row.failures
    assert not row.failures, row.failures


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_numerics_and_path(op, dtype):
    row = _check.check_op(op, "cpu", dtypes=(dtype,), run_opcheck=False)
    assert not row.failures, row.failures
    if NATIVE and op in KERNEL_OPS:
        assert row.native, row.reason
        assert _build.LAST_PATH[(op, "cpu")].reason.startswith("C++"), row.reason
        bwd = _build.LAST_PATH.get((f"{op}_backward", "cpu"))
        assert bwd is None or bwd.native, bwd


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: only the fallback exists")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_fallback_matches_native(op, dtype):
    _, args, grad_idx = _check.cases(op, getattr(torch, dtype), "cpu")
    fn = OPS[op][0]
    native, gout = _grads(fn, args, grad_idx)
    assert _build.LAST_PATH[(op, "cpu")].native
    with _build.force_reference():
        ref, _ = _grads(fn, args, grad_idx, gout)
        path = _build.LAST_PATH[(op, "cpu")]
    assert not path.native and "force_reference" in path.reason
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(native, ref):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("op", ["attention", "geglu", "layer_norm", "rms_norm", "rotary",
                                "swiglu"])
def test_eager_path_equals_custom_op(op):
    from torch.utils._python_dispatch import TorchDispatchMode

    _, args, grad_idx = _check.cases(op, torch.float32, "cpu")
    fn = OPS[op][0]
    fast, gout = _grads(fn, args, grad_idx)
    with _build.dispatcher_only():
        slow, _ = _grads(fn, args, grad_idx, gout)
    for a, b in zip(fast, slow):               # the same kernels: bit for bit
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():                                # a mode sees the custom op, not its insides
        fn(*args)
    assert f"meshlab.{op}.default" in seen, seen


def test_kernels_reject_what_they_do_not_handle():
    # float16 has no CPU kernel: the op runs the reference and says why.
    x = torch.randn(4, 8, dtype=torch.float16)
    y = OPS["rms_norm"][0](x, torch.ones(8))
    path = _build.LAST_PATH[("rms_norm", "cpu")]
    assert not path.native and "float16" in path.reason
    torch.testing.assert_close(y, OPS["rms_norm"][1](x, torch.ones(8)))
    with pytest.raises(ValueError, match=r"\(S, D/2\)"):
        OPS["rotary"][0](torch.randn(1, 4, 2, 8), torch.randn(4, 8), torch.randn(4, 8))


def test_linear_cross_entropy_edges():
    from meshlab.ops.linear_cross_entropy import default_chunk, linear_cross_entropy

    assert default_chunk(128256) == 4096 and default_chunk(32000) == 16384
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 9, 16, generator=g), torch.randn(50, 16, generator=g)
    t = torch.randint(0, 50, (2, 9), generator=g)
    t[0, :4] = -100
    want = OPS["linear_cross_entropy"][1](h.reshape(-1, 16), w, t.reshape(-1))
    for chunk in (1, 5, 18, 1000):              # chunks that split, end short, or exceed N
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk=chunk), want)
    # Every token ignored: NaN, as F.cross_entropy gives.
    assert linear_cross_entropy(h, w, torch.full_like(t, -100)).isnan()
    with pytest.raises(TypeError, match="cast one"):
        linear_cross_entropy(h, w.double(), t)
    with pytest.raises(ValueError, match=r"weight must be \(vocab, 16\)"):
        linear_cross_entropy(h, w[:, :8], t)
    with pytest.raises(ValueError, match="leading dims"):
        linear_cross_entropy(h, w, t[:, :3])
    hg = h.clone().requires_grad_()
    loss = linear_cross_entropy(hg, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    if NATIVE:
        with pytest.raises(RuntimeError, match="out of range"):
            linear_cross_entropy(h, w, t.masked_fill(t == t[1, 0], 50))


def test_non_contiguous_inputs():
    x = torch.randn(64, 6, 40).transpose(0, 1)           # (6, 64, 40), not contiguous
    w = torch.randn(40)
    torch.testing.assert_close(OPS["rms_norm"][0](x, w), OPS["rms_norm"][1](x, w))
    a, b = torch.randn(30, 20).t(), torch.randn(30, 20).t()
    torch.testing.assert_close(OPS["swiglu"][0](a, b), OPS["swiglu"][1](a, b))


@pytest.mark.skipif(not NATIVE, reason="the C++ kernels did not build")
def test_norm_weights_are_read_in_their_own_dtype():
    """A bfloat16 norm weight goes to the kernels as it is (they read it as float32), with the
    same outputs and gradients as its float32 copy, and the weight's gradient in its dtype."""
    from meshlab.ops.layer_norm import layer_norm
    from meshlab.ops.rms_norm import rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 48, generator=g, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(48, generator=g)).bfloat16()
    b = (0.1 * torch.randn(48, generator=g)).bfloat16()
    for fn, params in ((rms_norm, (w,)), (layer_norm, (w, b))):
        got = [t.clone().requires_grad_() for t in (x, *params)]
        ref = [x.clone().requires_grad_()] + [t.float().requires_grad_() for t in params]
        y, y_ref = fn(*got), fn(*ref)
        assert _build.LAST_PATH[(fn.__name__, "cpu")].native
        assert torch.equal(y, y_ref)
        dy = torch.randn(y.shape, generator=g).bfloat16()
        y.backward(dy)
        y_ref.backward(dy)
        assert torch.equal(got[0].grad, ref[0].grad)
        for p_, r in zip(got[1:], ref[1:]):
            assert p_.grad.dtype == torch.bfloat16
            assert torch.equal(p_.grad, r.grad.bfloat16())


def _add_norm_case(dtype, b=3, s=17, h=300):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(b, s, h, generator=g).to(dtype) for _ in "xr")
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    dy, ds = (torch.randn(b, s, h, generator=g).to(dtype) for _ in "ys")
    return x, r, w, dy, ds


def _add_norm_grads(fn, x, r, w, dy, ds):
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, total = fn(*leaves)
    return (y, total, *torch.autograd.grad((y, total), leaves, (dy, ds)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    """``add_rms_norm`` gives the sum exactly as the separate add rounds it, the norm of
    that sum, and the gradients autograd gives the add followed by the norm (the residual
    stream's gradient added inside the norm's backward); the C++ kernels run it on CPU and
    the eager path is the custom op's, bit for bit."""
    from meshlab.ops.rms_norm import add_rms_norm, rms_norm_reference

    x, r, w, dy, ds = _add_norm_case(dtype)

    got = _add_norm_grads(add_rms_norm, x, r, w, dy, ds)
    if NATIVE:
        assert _build.LAST_PATH[("add_rms_norm", "cpu")].native
        assert _build.LAST_PATH[("rms_norm_backward", "cpu")].native
    assert torch.equal(got[1], x + r)
    # The reference in float64 from the sum as the add rounds it, which the norm then reads.
    total, w64 = (x + r).double().requires_grad_(), w.double().requires_grad_()
    y64 = rms_norm_reference(total, w64)
    dtotal, dw64 = torch.autograd.grad(y64, (total, w64), dy.double())
    want = [t.detach() for t in (y64, total, dtotal + ds.double(), dtotal + ds.double(), dw64)]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **tol)
    with _build.dispatcher_only():
        slow = _add_norm_grads(add_rms_norm, x, r, w, dy, ds)
    for a, b in zip(got, slow):
        assert torch.equal(a, b)
    with _build.force_reference():
        ref = _add_norm_grads(add_rms_norm, x, r, w, dy, ds)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)
    with pytest.raises(ValueError, match="must match in shape and dtype"):
        add_rms_norm(x, r.double(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fork_adds_the_residual_gradient_inside_the_norm(dtype):
    """``rms_norm_fork`` returns the norm and ``x`` itself; the gradient reaching that view
    is added inside the norm's backward kernel, giving what autograd gives the norm and the
    identity used apart; only the view used, or only the norm, works too."""
    from meshlab.ops.rms_norm import rms_norm, rms_norm_fork

    x, _, w, dy, ds = _add_norm_case(dtype)

    def grads(fork, dy, ds):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        if fork:
            y, through = rms_norm_fork(*leaves)
            assert through._base is leaves[0] and torch.equal(through, x)
        else:
            y, through = rms_norm(*leaves), leaves[0]
        outs = [(o, g) for o, g in ((y, dy), (through, ds)) if g is not None]
        return torch.autograd.grad([o for o, _ in outs], leaves, [g for _, g in outs],
                                   allow_unused=True)

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for dy_, ds_ in ((dy, ds), (dy, None), (None, ds)):
        got, want = grads(True, dy_, ds_), grads(False, dy_, ds_)
        for a, b in zip(got, want):
            if b is None:
                assert a is None or not a.any()
            else:
                torch.testing.assert_close(a, b, **tol)
    if NATIVE:
        _build.LAST_PATH.clear()
        grads(True, dy, ds)
        assert _build.LAST_PATH[("rms_norm_backward", "cpu")].native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fork_compiled_adds_the_residual_gradient_inside_the_norm(dtype):
    """Under ``torch.compile`` the fork's backward is the custom op's with the residual
    stream's gradient passed in (one kernel, as eager runs it), not the norm's backward and
    a separate add; outputs and gradients equal the eager fork's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from meshlab.ops.rms_norm import rms_norm_fork

    x, _, w, dy, ds = _add_norm_case(dtype)
    w2 = torch.randn(x.shape[-1], x.shape[-1], generator=torch.Generator().manual_seed(1))
    w2 = w2.to(dtype)

    def block(a, b):
        y, through = rms_norm_fork(a, b)
        return through + (y @ w2).tanh()

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dy))

    compiled = torch.compile(block, fullgraph=True,
                             backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    got, want = run(compiled), run(block)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    backward = graphs[-1].graph
    calls = [n for n in backward.nodes
             if n.target is torch.ops.meshlab.rms_norm_backward.default]
    assert len(calls) == 1 and len(calls[0].args) == 5 and calls[0].args[4] is not None
    adds = [n for n in backward.nodes if n.target in (torch.ops.aten.add.Tensor,
                                                       torch.ops.aten.add_.Tensor)]
    assert not adds, backward
    torch.library.opcheck(torch.ops.meshlab.rms_norm_backward.default,
                          (dy, x, w, torch.ops.meshlab.rms_norm(x, w, 1e-6)[1], ds))


def test_add_rms_norm_opcheck():
    from meshlab.ops.rms_norm import add_rms_norm

    x, r, w, dy, ds = _add_norm_case(torch.float32, 2, 5, 67)
    y, total, rstd = torch.ops.meshlab.add_rms_norm(x, r, w, 1e-6)
    torch.library.opcheck(torch.ops.meshlab.add_rms_norm.default,
                          tuple(t.clone().requires_grad_() for t in (x, r, w)) + (1e-6,))
    torch.library.opcheck(torch.ops.meshlab.add_rms_norm_backward.default,
                          (dy, ds, total, w, rstd))
    compiled = torch.compile(lambda a, b, c: add_rms_norm(a, b, c), backend="aot_eager",
                             fullgraph=True)
    for a, b in zip(compiled(x, r, w), add_rms_norm(x, r, w)):
        assert torch.equal(a, b)


def test_failed_build_is_recorded_not_raised(monkeypatch):
    assert _build.cpu_extension("meshlab_missing_src", ("no_such_file.cpp",)) is None
    assert "sources not found" in _build.failure("meshlab_missing_src")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert _build.cpu_extension("meshlab_no_compiler", ("ops_cpu.cpp",)) is None
    assert "no C++ compiler" in _build.failure("meshlab_no_compiler")


def test_build_command(capsys):
    from meshlab import cli

    rc = cli.main(["build"])
    out = capsys.readouterr().out
    if NATIVE:
        assert rc == 0, out
        assert "3 of 3 extensions ready" in out and "meshlab_attention_cpu" in out
    else:
        assert rc == 1


def test_check_command_exit_code(capsys):
    from rich.console import Console

    assert _check.run(ops=["swiglu"], devices=["cpu"], run_opcheck=False,
                      console=Console(width=200)) == 0
    out = capsys.readouterr().out
    assert "swiglu" in out and ("native" in out if NATIVE else "fallback" in out)
    assert "fused_adamw" in out and "cpu_adamw" in out


# ---------------------------------------------------------------------------- CPUAdamW

def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    # 70_000 elements spans several of the kernel's work chunks; 3 tests the tail.
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in [(70_000,), (37, 11), (3,)]]


@pytest.mark.parametrize("force_reference", [False, True])
def test_cpu_adamw_matches_torch_adamw(force_reference):
    from meshlab.ops import CPUAdamW

    a, b = _params(0), _params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    oa, ob = CPUAdamW(a, **kw), torch.optim.AdamW(b, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for pa, pb in zip(a, b):
            pa.grad = torch.randn(pa.shape, generator=g)
            pb.grad = pa.grad.clone()
        if force_reference:
            with _build.force_reference():
                oa.step()
        else:
            oa.step()
        ob.step()
        assert oa.native is (NATIVE and not force_reference), oa.fallback_reason
    for pa, pb, p0 in zip(a, b, _params(0)):
        assert not torch.equal(pa.detach(), p0.detach())       # it did move
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=0, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(oa.state[pa][key], ob.state[pb][key], rtol=1e-6, atol=1e-7)
    # Same state layout: AdamW can take over from CPUAdamW.
    torch.optim.AdamW(b, **kw).load_state_dict(oa.state_dict())


# ---------------------------------------------------------------------------- DTensor

@pytest.fixture(scope="module")
def world():
    from tests._world import World

    w = World(2, env={"OMP_NUM_THREADS": "1"})
    yield w
    w.close()


def case_dtensor_ops(rank, world):
    """Each op on DTensors sharded over 2 ranks equals the op on the full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshlab.ops import OPS, _build

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)                                   # same global tensors on each rank
    B, S, H = 4, 6, 48
    x, w, b = torch.randn(B, S, H), torch.randn(H), torch.randn(H)
    q, ang = torch.randn(B, S, 3, 16), torch.randn(S, 8)
    cases = {
        "rms_norm": ((x, w), [(Shard(0), Replicate()), (Shard(1), Replicate())]),
        "layer_norm": ((x, w, b), [(Shard(0), Replicate(), Replicate())]),
        "swiglu": ((x, b.expand(B, S, H).contiguous()), [(Shard(0), Shard(0)),
                                                         (Shard(2), Shard(2))]),
        "rotary": ((q, ang.cos(), ang.sin()), [(Shard(0), Replicate(), Replicate()),
                                               (Shard(1), Shard(0), Shard(0))]),
    }
    # linear_cross_entropy: tokens split across ranks; the mean must be the global one even
    # though the ranks count different numbers of tokens.
    from meshlab.ops import linear_cross_entropy

    hid, head = torch.randn(12, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True)
    tgt = torch.randint(0, 30, (12,))
    tgt[:5] = -100                                          # rank 0 counts 1 token, rank 1 six
    want = linear_cross_entropy(hid, head, tgt, chunk=4)
    want_g = torch.autograd.grad(want, (hid, head))
    dh = distribute_tensor(hid.detach(), mesh, [Shard(0)]).requires_grad_()
    dw = distribute_tensor(head.detach(), mesh, [Replicate()]).requires_grad_()
    got = linear_cross_entropy(dh, dw, distribute_tensor(tgt, mesh, [Shard(0)]), chunk=4)
    got_g = torch.autograd.grad(got, (dh, dw))
    torch.testing.assert_close(got.full_tensor(), want.detach())
    for g, e in zip(got_g, want_g):
        torch.testing.assert_close(g.full_tensor(), e, rtol=1e-5, atol=1e-6)
    checked = []
    for op, (args, layouts) in cases.items():
        fn = OPS[op][0]
        full = [a.clone().requires_grad_() for a in args]
        want = fn(*full)
        gout = torch.randn_like(want)
        want_g = torch.autograd.grad(want, full, gout)
        for layout in layouts:
            dts = [distribute_tensor(a, mesh, [p]).requires_grad_() for a, p in zip(args, layout)]
            out = fn(*dts)
            assert out.placements == (layout[0],), (op, layout, out.placements)
            got_g = torch.autograd.grad(out, dts, distribute_tensor(gout, mesh, [layout[0]]))
            torch.testing.assert_close(out.full_tensor(), want, rtol=1e-5, atol=1e-5)
            for g, e in zip(got_g, want_g):
                torch.testing.assert_close(g.full_tensor(), e, rtol=1e-5, atol=1e-5)
            checked.append((op, str(layout[0])))
        assert _build.LAST_PATH[(op, "cpu")].native or not _build.ops_cpu()
    return checked + [("linear_cross_entropy", "S(0)")]


def test_dtensor_sharded_equals_unsharded(world):
    checked = world.run(case_dtensor_ops)
    assert checked[0] == checked[1] and len(checked[0]) == 8


def test_swiglu_wide_range():
    # The C++ kernel's own exp must hold over the whole float range, tails and infinities too.
    a = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([float("inf"), 0.0, -0.0])])
    b = torch.randn_like(a)
    want = (torch.nn.functional.silu(a.double()) * b.double()).float()
    got = OPS["swiglu"][0](a, b)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


def test_rotary_keeps_only_the_angles_for_backward():
    """The input's gradient is the output's rotated back: x is not kept for the backward
    (queries and keys of every layer would stay alive), unless the angles want gradients."""
    from meshlab.ops import rotary, rotary_reference

    x = torch.randn(2, 16, 4, 32, requires_grad=True)
    ang = torch.outer(torch.arange(16.0), torch.rand(16))
    for angles_grad in (False, True):
        cos, sin = ang.cos().requires_grad_(angles_grad), ang.sin().requires_grad_(angles_grad)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t,
                                                      lambda t: t):
            y = rotary(x, cos, sin)
        assert (tuple(x.shape) in map(tuple, kept)) == angles_grad, kept
        y.sum().backward()
        want = torch.autograd.grad(rotary_reference(x, cos, sin).sum(), x)[0]
        torch.testing.assert_close(x.grad, want, atol=1e-5, rtol=1e-5)
        x.grad = None


def _mlp_against_unfused(mlp, inter: int):
    """``mlp`` and the unfused SwiGLU MLP on the same float64 inputs (3 x 5 tokens, hidden
    8), each backward from the same output gradient: (out, want, ins, ref), ``ins`` and
    ``ref`` the two sides' leaves (x, w_gate, w_up, w_down) holding their gradients."""
    g = torch.Generator().manual_seed(0)
    x, wg, wu, wd = (torch.randn(s, generator=g, dtype=torch.float64) * 0.5 for s in
                     ((3, 5, 8), (inter, 8), (inter, 8), (8, inter)))
    ins = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    ref = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    dout = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    out = mlp(*ins)
    out.backward(dout)
    want = (torch.nn.functional.silu(ref[0] @ ref[1].T) * (ref[0] @ ref[2].T)) @ ref[3].T
    want.backward(dout)
    return out, want, ins, ref


def test_mlp_weight_gradients_come_from_one_product_of_side_by_side_gradients(monkeypatch):
    """Where the kernels write the gate's and the up projection's gradients as the halves
    of one buffer's rows (the Triton path, stood in for here by its math in torch), the
    fused MLP takes both weights' gradients from one product over that buffer: they are
    the halves of one tensor, and every gradient is the unfused MLP's in float64."""
    import importlib
    import types

    S = importlib.import_module("meshlab.ops.swiglu")

    calls = []

    def side_by_side(dy, a, b, act=0):
        calls.append(tuple(a.shape))
        sig = torch.sigmoid(a)
        da, db = dy * b * sig * (1 + a * (1 - sig)), dy * a * sig
        cols = a.shape[-1]
        both = torch.empty(a.numel() // cols, 2 * cols, dtype=a.dtype)
        both[:, :cols], both[:, cols:] = da.reshape(-1, cols), db.reshape(-1, cols)
        return both, a * sig * b

    stand_in = types.SimpleNamespace(swiglu_bwd_y_side_by_side=side_by_side)
    real = _build.kernels
    monkeypatch.setattr(_build, "kernels", lambda op, x: stand_in if op == "swiglu_backward_y"
                        else real(op, x))
    _, _, ins, ref = _mlp_against_unfused(S.swiglu_mlp, 12)
    assert calls == [(3, 5, 12)]
    for a, b, name in zip(ins, ref, ("x", "w_gate", "w_up", "w_down")):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert ins[1].grad.untyped_storage().data_ptr() == \
        ins[2].grad.untyped_storage().data_ptr()            # one product's two halves


def _quack_stand_in(calls):
    """quack-kernels' ``mlp_func`` contract with ``concat_layout=True`` (``w1`` the gate's
    rows above the up projection's, one ``(2 * intermediate, hidden)`` operand), in torch."""
    def mlp_func(x, w1, w2, activation, tuned=True, concat_layout=False):
        calls.append((tuple(w1.shape), activation, concat_layout))
        g, u = w1.chunk(2)
        return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ w2.T
    return mlp_func


def test_mlp_routes_to_quack_with_the_gate_and_up_weights_as_one_operand(monkeypatch):
    """Where quack-kernels takes the MLP (a Hopper card, stood in for here), it gets the
    gate and up weights concatenated in its concat layout, and autograd hands each weight
    its own half of the gradient: every output and gradient is the unfused MLP's in
    float64. With the route turned off the same call runs meshlab's own MLP."""
    import importlib

    S = importlib.import_module("meshlab.ops.swiglu")
    calls = []
    monkeypatch.setattr(S, "_quack_route", lambda *a: _quack_stand_in(calls))
    out, want, ins, ref = _mlp_against_unfused(S.swiglu_mlp, 16)
    assert calls == [((32, 8), "swiglu", True)]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for a, b, name in zip(ins, ref, ("x", "w_gate", "w_up", "w_down")):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_quack_route_takes_only_what_its_kernels_take(monkeypatch):
    """The route needs eager CUDA tensors in bf16/fp16 that want a gradient, SwiGLU, sizes
    in multiples of 8 and the switch on; anything else runs meshlab's own MLP (here on the
    CPU: no route whatever is installed)."""
    import importlib

    S = importlib.import_module("meshlab.ops.swiglu")
    monkeypatch.setattr(S, "_quack_mlp", lambda: (_quack_stand_in([]), "stand-in"))
    x, wg, wu, wd = torch.randn(2, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    wg.requires_grad_()
    assert S.QUACK_MLP is False                 # off until a training step is measured on it
    assert S._quack_route(x, wg, wu, wd, "swiglu") is None
    monkeypatch.setattr(S, "QUACK_MLP", True)
    assert S._quack_route(x, wg, wu, wd, "swiglu") is None          # a CPU tensor


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_mlp_with_a_residual_adds_it_inside_the_down_product(name):
    """``swiglu_mlp(..., residual=r)`` is ``r + swiglu_mlp(...)`` in float64 to rounding,
    forward and every gradient (the residual's is the output's), with no add of its own
    over the output (``addmm`` takes it); a residual of another shape is refused."""
    from meshlab.ops import geglu_mlp, swiglu_mlp

    fn = swiglu_mlp if name == "swiglu" else geglu_mlp
    g = torch.Generator().manual_seed(0)
    x, r, wg, wu, wd = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
                        for s in ((2, 9, 16), (2, 9, 16), (32, 16), (32, 16), (16, 32)))
    gout = torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = fn(x, wg, wu, wd, residual=r)
    assert not [e for e in prof.events() if e.name in ("aten::add", "aten::add_")]
    gots = torch.autograd.grad(got, (x, r, wg, wu, wd), gout)
    want = r + fn(x, wg, wu, wd)
    wants = torch.autograd.grad(want, (x, r, wg, wu, wd), gout)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(gots, wants):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="residual"):
        fn(x, wg, wu, wd, residual=r[:, :3])


def test_compiled_mlp_backward_sums_the_input_gradient_in_one_op():
    """Compiled, the MLP's input gradient ``da @ w_gate + db @ w_up`` was an out-of-place
    ``addmm``, which cuBLAS runs as a copy of the first product and then the second (one
    64 MiB device copy per block at TinyLlama's shape). It is now ``meshlab::mm_sum``,
    whose kernel accumulates in place, as the eager backward does."""
    from torch._inductor.utils import run_and_get_code

    from meshlab.ops.swiglu import swiglu_mlp

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, wg, wu = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
                 for s in ((6, 8), (16, 8), (16, 8)))
    wd = torch.randn(8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(swiglu_mlp, fullgraph=True)
    _, codes = run_and_get_code(lambda: compiled(x, wg, wu, wd).square().sum().backward())
    got = [t.grad.clone() for t in (x, wg, wu, wd)]
    backward = [c for c in codes if "mm_sum" in c]
    assert backward, "the compiled backward does not call meshlab::mm_sum"
    assert not any("addmm" in c for c in backward), backward[0]
    for t in (x, wg, wu, wd):
        t.grad = None
    ref = torch.nn.functional.silu(x @ wg.T) * (x @ wu.T) @ wd.T
    ref.square().sum().backward()
    for a, t in zip(got, (x, wg, wu, wd)):
        torch.testing.assert_close(a, t.grad, rtol=1e-12, atol=1e-12)


def test_float64_inputs_compute_in_float64():
    """The PyTorch math that float64 tensors take computed in float32 (the norms' forward
    and backward, the gated activations' backward): a float64 model under ``fuse()`` was
    off the single process by about 1e-6 relative, the size of error float64 runs are
    there to expose (attention's backward took the forward's log-sum-exp in float32).
    Each now matches float64 autograd to rounding."""
    from meshlab.ops.attention import attention
    from meshlab.ops.layer_norm import layer_norm
    from meshlab.ops.rms_norm import rms_norm
    from meshlab.ops.swiglu import swiglu_mlp

    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)

    F = torch.nn.functional
    x, w, b = r(6, 8), r(8), r(8)
    wg, wu, wd = r(16, 8), r(16, 8), r(8, 16)
    q, k, v = r(2, 4, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 8)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                              v.repeat_interleave(2, 1), is_causal=True)

    cases = {
        "attention": ((q, k, v), lambda q, k, v: attention(q, k, v, causal=True), sdpa),
        "rms_norm": ((x, w), lambda x, w: rms_norm(x, w),
                     lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w),
        "layer_norm": ((x, w, b), lambda x, w, b: layer_norm(x, w, b),
                       lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5)),
        "swiglu_mlp": ((x, wg, wu, wd), swiglu_mlp,
                       lambda x, wg, wu, wd: (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T),
    }
    for name, (args, fn, ref) in cases.items():
        got = torch.autograd.grad(fn(*args).square().sum(), args)
        want = torch.autograd.grad(ref(*args).square().sum(), args)
        torch.testing.assert_close(fn(*args), ref(*args), rtol=1e-12, atol=1e-12, msg=name)
        for i, (a, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, e, rtol=1e-11, atol=1e-11,
                                       msg=lambda m: f"{name} gradient {i}: {m}")


def test_hopper_package_takes_what_imports_and_names_what_does_not(tmp_path, monkeypatch):
    """flash-attn-4's and quack-kernels' loader (``_build.hopper_package``): a package
    that imports gives its object, one without the submodule (flash-attn 2's
    ``flash_attn``) gives None, and one that fails to import raises naming the fix."""
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    for pkg, files in {"okpkg": {"__init__.py": "", "cute.py": "fn = 7\n"},
                       "nocute": {"__init__.py": ""},
                       "badpkg": {"__init__.py": "", "cute.py": "import no_such_dsl\n"}}.items():
        (tmp_path / pkg).mkdir()
        for name, text in files.items():
            (tmp_path / pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert _build.hopper_package("okpkg.cute", "okpkg", "fn", "x") == (7, "?")
        assert _build.hopper_package("nocute.cute", "nocute", "fn", "x") is None
        assert _build.hopper_package("absent_pkg.cute", "absent", "fn", "x") is None
        with pytest.raises(ImportError, match=r"badpkg is installed but cannot be imported"
                                              r".*uninstall badpkg \(attention runs"):
            _build.hopper_package("badpkg.cute", "badpkg", "fn", "attention runs on cuDNN")
    finally:
        for m in [m for m in sys.modules if m.split(".")[0] in ("okpkg", "nocute", "badpkg")]:
            del sys.modules[m]
