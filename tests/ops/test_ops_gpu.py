"""The fused ops' Triton kernels on a CUDA device: the Triton path is taken, outputs and
gradients match the reference in float32 and bfloat16, and opcheck passes."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OPS = ("rms_norm", "rotary", "swiglu", "geglu", "layer_norm", "linear_cross_entropy")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_triton_matches_reference(op, dtype):
    pytest.importorskip("triton")
    from meshlab.ops import check as _check
    from meshlab.ops import _build

    row = _check.check_op(op, "cuda", dtypes=(dtype,), run_opcheck=False)
    assert row.native, row.reason
    assert _build.LAST_PATH[(op, "cuda")].reason.startswith("Triton"), _build.LAST_PATH
    assert not row.failures, row.failures


@pytest.mark.parametrize("op", OPS)
def test_opcheck_cuda(op):
    pytest.importorskip("triton")
    from meshlab.ops import check as _check

    row = _check.check_op(op, "cuda", dtypes=("bfloat16",), run_opcheck=True, small=True)
    assert not row.failures, row.failures


@pytest.mark.parametrize("tokens", [1, 7, 4099])
def test_norm_backward_bands(tokens):
    """Weight gradients are summed in bands of rows; odd row counts must lose none."""
    pytest.importorskip("triton")
    from meshlab.ops import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

    x = torch.randn(tokens, 4096, device="cuda", requires_grad=True)
    w = torch.randn(4096, device="cuda", requires_grad=True)
    b = torch.randn(4096, device="cuda", requires_grad=True)
    for fn, ref, args in ((rms_norm, rms_norm_reference, (x, w)),
                          (layer_norm, layer_norm_reference, (x, w, b))):
        g = torch.randn(tokens, 4096, device="cuda")
        got = torch.autograd.grad(fn(*args), args, g)
        want = torch.autograd.grad(ref(*args), args, g)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_mlp_matches_the_module_calls(dtype, residual):
    """The fused MLP function (Triton backward that rebuilds the product) against the
    unfused math in float32 autograd: output and the four gradients; with a residual
    added inside the down product, its gradient too."""
    pytest.importorskip("triton")
    from meshlab.ops import swiglu_mlp

    g = torch.Generator(device="cuda").manual_seed(0)
    x, wg, wu = (torch.randn(s, device="cuda", generator=g) * 0.5 for s in
                 ((3, 37, 64), (176, 64), (176, 64)))
    wd = torch.randn(64, 176, device="cuda", generator=g) * 0.5
    dout = torch.randn(3, 37, 64, device="cuda", generator=g)
    r = torch.randn(3, 37, 64, device="cuda", generator=g)
    ins = [t.to(dtype).requires_grad_() for t in (x, wg, wu, wd, r)]
    ref = [t.detach().float().requires_grad_() for t in ins]
    out = swiglu_mlp(*ins[:4], residual=ins[4] if residual else None)
    out.backward(dout.to(dtype))
    want = (torch.nn.functional.silu(ref[0] @ ref[1].T) * (ref[0] @ ref[2].T)) @ ref[3].T
    (want + ref[4] if residual else want).backward(dout)
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=0.5, rtol=3e-2)
    torch.testing.assert_close(out.float(), want + ref[4] if residual else want, **tol)
    for a, b, name in zip(ins, ref, ("x", "w_gate", "w_up", "w_down", "residual")):
        if name != "residual" or residual:
            torch.testing.assert_close(a.grad.float(), b.grad, msg=name, **tol)
    # the gated pass wrote the two gradients side by side: one product gave both weights'
    assert ins[1].grad.untyped_storage().data_ptr() == ins[2].grad.untyped_storage().data_ptr()


def test_swiglu_mlp_on_quack_matches_the_module_calls(monkeypatch):
    """With its route on, where quack-kernels is installed on a Hopper card, the MLP runs
    on its gated GEMMs (the route says so): output and the four gradients against float32
    autograd."""
    import importlib

    from meshlab.ops import _build, swiglu_mlp

    S = importlib.import_module("meshlab.ops.swiglu")
    monkeypatch.setattr(S, "QUACK_MLP", True)
    if S._quack_mlp() is None:
        pytest.skip("quack-kernels is not installed, or this is not a Hopper card")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 128, 256, device="cuda", generator=g) * 0.5
    wg, wu = (torch.randn(704, 256, device="cuda", generator=g) * 256 ** -0.5 for _ in "gu")
    wd = torch.randn(256, 704, device="cuda", generator=g) * 704 ** -0.5
    dout = torch.randn(3, 128, 256, device="cuda", generator=g)
    ins = [t.bfloat16().requires_grad_() for t in (x, wg, wu, wd)]
    ref = [t.detach().float().requires_grad_() for t in ins]
    out = swiglu_mlp(*ins)
    out.backward(dout.bfloat16())
    assert "quack-kernels" in _build.LAST_PATH[("swiglu_mlp", "cuda")].reason
    want = (torch.nn.functional.silu(ref[0] @ ref[1].T) * (ref[0] @ ref[2].T)) @ ref[3].T
    want.backward(dout)
    for got, exp, name in zip([out] + [t.grad for t in ins], [want] + [t.grad for t in ref],
                              ("out", "x", "w_gate", "w_up", "w_down")):
        err = float((got.float() - exp).norm() / exp.norm())
        assert err < 1e-2, (name, err)


def test_forwards_read_merged_parts_in_place():
    """The parts of a merged projection's product (rows holding every part) go into the
    rotary and swiglu forwards as strided views, read in place, and so do the rotary's
    angles as Hugging Face holds them (bf16 (S, D) tables, their first halves sliced) and
    a norm's bf16 weight: the results equal those of contiguous float32 copies, and no
    copy or cast kernel runs."""
    from meshlab.ops.rms_norm import rms_norm
    from meshlab.ops.rotary import rotary
    from meshlab.ops.swiglu import swiglu

    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, kv, d, inter = 5, 4, 2, 64, 96
    qkv = torch.randn(1, t, (h + 2 * kv) * d, device="cuda", dtype=torch.bfloat16,
                      generator=g)
    q = qkv[..., :h * d].view(1, t, h, d)
    ang = torch.randn(t, d // 2, device="cuda", generator=g)
    table = torch.cat([ang, ang], -1)
    cos, sin = table.cos().bfloat16()[:, :d // 2], table.sin().bfloat16()[:, :d // 2]
    gu = torch.randn(1, t, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=g)
    a, b = gu.chunk(2, -1)
    x = qkv[..., :h * d].contiguous()
    w = torch.rand(h * d, device="cuda", generator=g).bfloat16()
    assert not q.is_contiguous() and not a.is_contiguous()
    rms_norm(x, w)                                          # the Triton kernel compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        got_q = rotary(q, cos, sin)
        got_y = swiglu(a, b)
        got_n = rms_norm(x, w)
        torch.cuda.synchronize()
    kernels = [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 3 and not any("copy" in k.lower() for k in kernels), kernels
    assert torch.equal(got_n, rms_norm(x, w.float()))
    assert torch.equal(got_q, rotary(q.contiguous(), cos.float().contiguous(),
                                     sin.float().contiguous()))
    assert torch.equal(got_y, swiglu(a.contiguous(), b.contiguous()))
    assert got_q.is_contiguous() and got_y.is_contiguous()


def test_cache_write_is_one_launch_and_equals_index_copy():
    """A step's keys and values go into the paged caches in one Triton launch, the values
    read as the strided part of a merged product they are; the caches equal those that
    two ``index_copy_`` calls write."""
    from meshlab.ops.paged_attention import write_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    t, hkv, d, blocks, bs = 6, 2, 64, 5, 4
    kv = torch.randn(t, 3 * hkv * d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = kv[:, hkv * d:2 * hkv * d].reshape(t, hkv, d).contiguous()
    v = kv[:, 2 * hkv * d:].view(t, hkv, d)
    slots = torch.randperm(blocks * bs, device="cuda", generator=g)[:t]
    caches = [torch.zeros(blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(4)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        write_cache(caches[0], caches[1], slots, k, v)
        torch.cuda.synchronize()
    kernels = [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_write_kv"], kernels
    caches[2].view(-1, hkv, d).index_copy_(0, slots, k)
    caches[3].view(-1, hkv, d).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fork_triton(dtype, compiled):
    """The residual stream's gradient added inside the norm's Triton backward, eagerly and
    inside a graph inductor compiled: what autograd gives the norm and the identity used
    apart."""
    pytest.importorskip("triton")
    from meshlab.ops import _build
    from meshlab.ops.rms_norm import rms_norm, rms_norm_fork

    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy, ds = (torch.randn(3, 17, 300, device="cuda", generator=g).to(dtype)
                 for _ in range(3))
    w = (1 + 0.1 * torch.randn(300, device="cuda", generator=g)).to(dtype)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        y, through = fn(*leaves)
        return torch.autograd.grad((y, through), leaves, (dy, ds))

    _build.LAST_PATH.clear()
    got = grads(torch.compile(rms_norm_fork, fullgraph=True) if compiled else rms_norm_fork)
    assert _build.LAST_PATH[("rms_norm_backward", "cuda")].reason.startswith("Triton")
    want = grads(lambda a, b: (rms_norm(a, b), a * 1))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_triton(dtype):
    """The residual add and the norm in one Triton pass: the sum as the separate add rounds
    it, outputs and gradients those of the add then the norm, and opcheck passes."""
    pytest.importorskip("triton")
    from meshlab.ops import _build
    from meshlab.ops.rms_norm import add_rms_norm, rms_norm_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    x, r, dy, ds = (torch.randn(3, 17, 300, device="cuda", generator=g).to(dtype)
                    for _ in range(4))
    w = (1 + 0.1 * torch.randn(300, device="cuda", generator=g)).to(dtype)

    def grads(fn, *args):
        leaves = [t.clone().requires_grad_() for t in args]
        y, total = fn(*leaves)
        return (y, total, *torch.autograd.grad((y, total), leaves, (dy.to(y.dtype),
                                                                      ds.to(y.dtype))))

    got = grads(add_rms_norm, x, r, w)
    assert _build.LAST_PATH[("add_rms_norm", "cuda")].reason.startswith("Triton")
    assert torch.equal(got[1], x + r)
    # The reference in float64 from the sum as the add rounds it, which the norm then reads.
    total, w64 = (x + r).double().requires_grad_(), w.double().requires_grad_()
    y64 = rms_norm_reference(total, w64)
    dtotal, dw64 = torch.autograd.grad(y64, (total, w64), dy.double())
    want = (y64, total, dtotal + ds.double(), dtotal + ds.double(), dw64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.detach(), rtol=tol, atol=tol)
    y, total, rstd = torch.ops.meshlab.add_rms_norm(x, r, w, 1e-6)
    torch.library.opcheck(torch.ops.meshlab.add_rms_norm.default,
                          tuple(t.clone().requires_grad_() for t in (x, r, w)) + (1e-6,))
    torch.library.opcheck(torch.ops.meshlab.add_rms_norm_backward.default,
                          (dy, ds, total, w, rstd))


def test_dependent_launch_chain_reads_what_the_kernel_before_wrote():
    """On compute capability 9.0 and later the forward kernels launch with programmatic
    dependent launch (each waits for the one before inside the kernel, the matrix-vector
    kernel reading its first weight tile before that wait). A chain in which every kernel
    reads the output of the one just before, replayed from a CUDA graph, equals the same
    chain run one kernel after another, bit for bit."""
    pytest.importorskip("triton")
    from meshlab.ops import _triton, _triton_gemv, _triton_paged

    dev = torch.device("cuda", torch.cuda.current_device())
    on = _triton.pdl(dev)
    assert on == (torch.cuda.get_device_capability(dev)[0] >= 9)
    g = torch.Generator(device="cuda").manual_seed(0)
    h, f, kv, d = 2048, 5632, 4, 64
    w_in = torch.randn(h, h, device=dev, generator=g, dtype=torch.bfloat16) * h ** -0.5
    w_up = torch.randn(2 * f, h, device=dev, generator=g, dtype=torch.bfloat16) * h ** -0.5
    w_dn = torch.randn(h, f, device=dev, generator=g, dtype=torch.bfloat16) * f ** -0.5
    norm = torch.rand(h, device=dev, generator=g, dtype=torch.bfloat16) + 0.5
    cos = torch.rand(4, d // 2, device=dev, generator=g)
    sin = torch.rand(4, d // 2, device=dev, generator=g)
    cache = torch.zeros(2, 8, 16, kv, d, device=dev, dtype=torch.bfloat16)
    tables = torch.arange(8, device=dev, dtype=torch.int32).view(1, 8)
    x0 = torch.randn(h, device=dev, generator=g, dtype=torch.bfloat16)

    def chain():
        x = x0
        for i in range(6):
            y = _triton_gemv.gemv(x, w_in, g=norm, eps=1e-5)         # norm inside
            q = _triton.rotary_fwd(y.view(1, 1, h // d, d), cos[i % 4:], sin[i % 4:])
            kvs = q.view(h // d, d)[:kv].unsqueeze(0)
            slot = torch.full((1,), 20 * i + 20, device=dev)
            if i % 2 == 0:
                _triton_paged.write_kv(cache[0], cache[1], slot, kvs, kvs)
            att = _triton_paged.paged_attention_fwd(   # odd steps: the write inside it
                q.view(1, h // d, d), cache[0], cache[1], tables,
                torch.zeros(1, device=dev, dtype=torch.int32),
                torch.full((1,), 20 * i + 21, device=dev, dtype=torch.int32), d ** -0.5,
                splits=2,                           # from i = 3 on, two shares combined
                new=(kvs, kvs, slot) if i % 2 else None)
            y2, s, _ = _triton.add_rms_norm_fwd(att.view(1, h), x.view(1, h), norm, 1e-5)
            up = y2.view(h) @ w_up.t()             # cuBLAS between, as for gate/up
            a = _triton.swiglu_fwd(up[:f].view(1, f), up[f:].view(1, f))
            x = _triton_gemv.gemv(a.view(f), w_dn, r=s.view(h))      # residual inside
            x = _triton.rms_norm_fwd(x.view(1, h), norm, 1e-5)[0].view(h)
        return x

    _triton._PDL[dev.index] = False
    try:
        cache.zero_()
        want = chain().clone()
    finally:
        _triton._PDL[dev.index] = on
    chain()                                      # compile the PDL variants before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(20):
        cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_linear_cross_entropy_on_cuda(dtype, one_process):
    """The split loss's CUDA path (NCCL, one rank holding every row): the loss and both
    gradients of the whole-logits loss, in float32 and bfloat16 (statistics in float32)."""
    import socket

    import torch.distributed as dist

    from meshlab.ops.linear_cross_entropy import (linear_cross_entropy_reference,
                                                  linear_cross_entropy_split)

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 64, device="cuda", generator=g).to(dt)
    w = (torch.randn(1000, 64, device="cuda", generator=g) * 0.1).to(dt)
    t = torch.randint(0, 1000, (300,), device="cuda", generator=g)
    t[::7] = -100
    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = linear_cross_entropy_reference(ref_h, ref_w, t)
    ref.backward()
    mine_h, mine_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy_split(mine_h, mine_w, t, start=0, vocab=1000,
                                      group=dist.group.WORLD, chunk=128)
    loss.backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, ref.float(), **tol)
    torch.testing.assert_close(mine_h.grad.float(), ref_h.grad.float(), **tol)
    torch.testing.assert_close(mine_w.grad.float(), ref_w.grad.float(), **tol)
