"""meshlab::attention on the CPU: opcheck, forward and gradients against the reference in
float32 and bfloat16 (causal or not, grouped-query, sequences off the tile size), the C++
path taken and the fallback giving the same numbers, the typed errors, DTensor inputs
sharded on batch and heads across two gloo ranks, the CUDA plumbing on meta tensors, and
the Hugging Face bridge against eager attention in a tiny Llama."""

from __future__ import annotations

import copy
import os
import shutil
import sys
import types

import pytest
import torch

from meshlab import ConfigError
from meshlab.ops import check as _check
from meshlab.ops import _build, attention, attention_reference, hf_attention, register_hf

# ``meshlab.ops.attention`` the attribute is the function; the module is in sys.modules.
attn_mod = sys.modules["meshlab.ops.attention"]
cuda_mod = sys.modules["meshlab.ops._attention_cuda"]       # its CUDA kernels

NATIVE = shutil.which(os.environ.get("CXX", "c++")) is not None and \
    os.environ.get("MESHLAB_OPS_NATIVE", "1") != "0"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module", autouse=True)
def built():
    mod = _build.attention_cpu()
    if NATIVE:
        assert mod is not None, f"attention kernel failed to build: " \
                                f"{_build.failure('meshlab_attention_cpu')}"
    return mod


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(b, hq, hkv, s, skv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype)
            for shape in ((b, hq, s, d), (b, hkv, skv, d), (b, hkv, skv, d))]


def _fwd_bwd(fn, q, k, v, gout=None, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    gout = torch.randn_like(out) if gout is None else gout
    return (out, *torch.autograd.grad(out, leaves, gout)), gout


# (B, Hq, Hkv, S, Skv, D, causal, scale): grouped 4/2 and 4/1, S off the 64-row tiles (37,
# 130), one query against many keys, D 24 and 64, an explicit scale.
SHAPES = [
    (2, 4, 2, 37, 37, 24, True, None),
    (2, 4, 2, 37, 37, 64, False, None),
    (1, 4, 1, 130, 130, 64, True, 0.2),
    (2, 4, 1, 130, 61, 24, False, None),
    (1, 4, 2, 1, 37, 64, False, None),
]


def test_opcheck():
    row = _check.check_op("attention", "cpu", dtypes=("float32", "bfloat16"), small=True)
    assert row.opcheck == "pass", row.failures
    assert not row.failures, row.failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) +
                         ("-causal" if s[6] else "") + ("-scale" if s[7] else ""))
def test_matches_reference(shape, dtype):
    b, hq, hkv, s, skv, d, causal, scale = shape
    q, k, v = _inputs(b, hq, hkv, s, skv, d, dtype)
    got, gout = _fwd_bwd(attention, q, k, v, causal=causal, scale=scale)
    if NATIVE:
        for op in ("attention", "attention_backward"):
            path = _build.LAST_PATH[(op, "cpu")]
            assert path.native and path.reason == "C++ kernel (csrc/attention_cpu.cpp)", path
    want, _ = _fwd_bwd(attention_reference, q, k, v, gout, causal=causal, scale=scale)
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert _rel(a, e) < TOL[dtype], (name, _rel(a, e))
    # lse is the log-sum-exp of the scaled, masked scores.
    sc = d ** -0.5 if scale is None else scale
    _, lse = torch.ops.meshlab.attention(q, k, v, causal, sc)
    scores = attn_mod._scores(q, k, causal, sc)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, s)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_single_query_causal():
    # One query seeing one key: the output is that value, and q and k get no gradient.
    q, k, v = _inputs(2, 4, 2, 1, 1, 24, torch.float32)
    gout = torch.randn(2, 4, 1, 24, generator=torch.Generator().manual_seed(1))
    out, dq, dk, dv = _fwd_bwd(attention, q, k, v, gout, causal=True)[0]
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))
    # dS = P * (dout.v - dout.out) with out == v: zero up to float32 summation order.
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5 and dv.abs().max() > 0.1


def test_causal_never_reads_the_future():
    q, k, v = _inputs(1, 2, 1, 100, 100, 24, torch.float32)
    out = attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 70:] += 100.0
    v2[:, :, 70:] += 1e4
    out2 = attention(q, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, :70], out[:, :, :70], rtol=0, atol=0)


@pytest.mark.skipif(not NATIVE, reason="no C++ compiler: only the fallback exists")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fallback_matches_native(monkeypatch, dtype):
    q, k, v = _inputs(2, 4, 2, 70, 70, 24, dtype)
    native, gout = _fwd_bwd(attention, q, k, v, causal=True)
    assert _build.LAST_PATH[("attention", "cpu")].native
    monkeypatch.setenv("MESHLAB_OPS_NATIVE", "0")
    ref, _ = _fwd_bwd(attention, q, k, v, gout, causal=True)
    for op in ("attention", "attention_backward"):
        path = _build.LAST_PATH[(op, "cpu")]
        assert not path.native and path.reason == "MESHLAB_OPS_NATIVE=0", path
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(native, ref):
        torch.testing.assert_close(a, b, **tol)


def test_float16_runs_the_reference():
    q, k, v = _inputs(1, 2, 2, 9, 9, 16, torch.float16)
    out = attention(q, k, v, causal=True)
    path = _build.LAST_PATH[("attention", "cpu")]
    assert not path.native and "float16" in path.reason, path
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=True))


def test_non_contiguous_inputs():
    # Hugging Face hands over (B, S, H, D) projections transposed to (B, H, S, D).
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 21, 4, 24, generator=g).transpose(1, 2)
    k = torch.randn(2, 21, 2, 24, generator=g).transpose(1, 2)
    v = torch.randn(2, 21, 2, 24, generator=g).transpose(1, 2)
    got, gout = _fwd_bwd(attention, q, k, v, causal=True)
    want, _ = _fwd_bwd(attention_reference, q, k, v, gout, causal=True)
    assert got[0].is_contiguous()
    for a, e in zip(got, want):
        assert _rel(a, e) < 1e-5


BAD = [
    # (q shape, k shape, v shape, causal, message fragment)
    ((4, 9, 16), (2, 4, 9, 16), (2, 4, 9, 16), False, r"q \(4, 9, 16\)"),
    ((2, 4, 9, 16), (2, 4, 9), (2, 4, 9, 16), False, r"k \(2, 4, 9\)"),
    ((2, 4, 9, 16), (2, 4, 9, 16), (2, 4, 8, 16), False, "one shape"),
    ((2, 6, 9, 16), (2, 4, 9, 16), (2, 4, 9, 16), False, r"Hq=6 .* Hkv=4"),
    ((2, 4, 9, 16), (2, 2, 12, 16), (2, 2, 12, 16), True, r"S=9, Skv=12"),
    ((2, 4, 9, 16), (2, 2, 9, 8), (2, 2, 9, 8), False, r"head dim D.*\(2, 2, 9, 8\)"),
    ((2, 4, 9, 16), (3, 2, 9, 16), (3, 2, 9, 16), False, r"batch size B.*\(3, 2, 9, 16\)"),
]


@pytest.mark.parametrize("qs, ks, vs, causal, msg", BAD)
def test_bad_shapes_raise_before_running(qs, ks, vs, causal, msg):
    _build.LAST_PATH.pop(("attention", "cpu"), None)
    with pytest.raises(ValueError, match=msg):
        attention(torch.randn(qs), torch.randn(ks), torch.randn(vs), causal=causal)
    with pytest.raises(ValueError, match=msg):
        attention_reference(torch.randn(qs), torch.randn(ks), torch.randn(vs), causal=causal)
    assert ("attention", "cpu") not in _build.LAST_PATH       # nothing ran


def test_mixed_dtypes_raise():
    q, k, v = _inputs(1, 2, 2, 5, 5, 8, torch.float32)
    with pytest.raises(TypeError, match="one dtype"):
        attention(q, k.bfloat16(), v)


# ---------------------------------------------------------------------------- CUDA plumbing

def test_cuda_calls_fit_the_aten_schemas():
    """The aten calls of the CUDA path, run on meta tensors: arguments and the lse layouts
    (cuDNN's (B, H, S, 1), memory-efficient's rows padded to 32) round-trip."""
    b, h, s, d = 2, 4, 37, 24
    q, k, v = (torch.empty(b, h, s, d, device="meta", dtype=torch.bfloat16) for _ in range(3))
    for fwd, bwd in ((cuda_mod._cudnn_fwd, cuda_mod._cudnn_bwd),
                     (cuda_mod._efficient_fwd, cuda_mod._efficient_bwd)):
        out, lse = fwd(q, k, v, True, 0.2)
        assert out.shape == (b, h, s, d)
        assert lse.shape == (b, h, s) and lse.dtype == torch.float32 and lse.is_contiguous()
        grads = bwd(torch.empty_like(out), q, k, v, out, lse, True, 0.2)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    # cuDNN writes out and the gradients in the inputs' layout: with Hugging Face's
    # (B, S, H, D)-ordered queries the op's promise (``_layout``) costs no copy; the
    # memory-efficient kernel writes (B, S, H, D) memory whatever its inputs.
    bshd = [torch.empty(b, s, h, d, device="meta", dtype=torch.bfloat16).transpose(1, 2)
            for _ in range(3)]
    out, lse = cuda_mod._cudnn_fwd(*bshd, True, 0.2)
    grads = cuda_mod._cudnn_bwd(torch.empty_like(out), *bshd, out, lse, True, 0.2)
    assert [t.stride() for t in (out, *grads)] == [bshd[0].stride()] * 4
    out, _ = cuda_mod._efficient_fwd(q, k, v, True, 0.2)
    assert out.stride() == bshd[0].stride()
    assert cuda_mod._cudnn_lse_rank() in (3, 4)
    assert cuda_mod._efficient_lse_len(37) in (37, 64)
    # Grouped-query: kv heads repeated for the kernels, their gradients summed back.
    kv = torch.randn(2, 2, 5, 3)
    big = cuda_mod._expand(kv, 3)
    assert big.shape == (2, 6, 5, 3) and torch.equal(big[:, 3:6], kv[:, 1:2].expand(2, 3, 5, 3))
    torch.testing.assert_close(cuda_mod._reduce(big, 3), kv * 3)


def _stand_in_fa4(monkeypatch, calls):
    """flash-attn-4's two entry points as the op calls them, in its (B, S, H, D) layout and
    contiguous as it returns them, computed by the reference math (the layouts and the
    autograd wiring of ``meshlab::flash_attention_4`` are what a CPU can test)."""
    def fwd(q, k, v, softmax_scale, causal, return_lse):
        assert return_lse and q.shape[1] == k.shape[1]               # (B, S, H, D)
        calls.append("fwd")
        t = lambda x: x.transpose(1, 2)                                # noqa: E731
        out, lse = attn_mod._fwd_torch(t(q), t(k), t(v), causal, softmax_scale)
        return t(out).contiguous(), lse.float()                  # float32, as its lse

    def bwd(q, k, v, out, dout, lse, scale, causal):
        calls.append("bwd")
        t = lambda x: x.transpose(1, 2)                                # noqa: E731
        return [t(g).contiguous() for g in
                attn_mod._bwd_torch(t(dout), t(q), t(k), t(v), t(out), lse, causal, scale)]

    monkeypatch.setattr(attn_mod, "_flash_attn_4", lambda: (fwd, "stand-in"))
    monkeypatch.setattr(attn_mod, "_flash_attn_4_backward", lambda: bwd)


@pytest.mark.parametrize("layout", ["contiguous", "hugging_face"])
def test_flash_attention_4_op_matches_reference(monkeypatch, layout):
    """``meshlab::flash_attention_4`` (flash-attn-4 inside a compiled graph) hands its inputs
    over transposed to (B, S, H, D), returns the output and gradients in the layouts its
    fake kernels promise, and its autograd gives the reference's gradients, grouped-query
    heads summed by the kernel."""
    calls = []
    _stand_in_fa4(monkeypatch, calls)
    b, hq, hkv, s, d = 2, 4, 2, 37, 64
    g = torch.Generator().manual_seed(3)
    if layout == "contiguous":
        q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    else:                           # projections viewed as (B, S, H, D), then transposed
        q, k, v = (torch.randn(b, s, h, d, generator=g).transpose(1, 2)
                   for h in (hq, hkv, hkv))
    got, gout = _fwd_bwd(lambda *a: torch.ops.meshlab.flash_attention_4(*a, True, 0.125)[0],
                         q, k, v)
    want, _ = _fwd_bwd(attention_reference, q, k, v, gout, causal=True, scale=0.125)
    assert calls == ["fwd", "bwd"]
    for a, e, ref in zip(got, want, (q, q, k, v)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        assert a.stride() == attn_mod._bshd_empty(ref).stride()   # as the fakes promise
    torch.library.opcheck(torch.ops.meshlab.flash_attention_4.default, (q, k, v, True, 0.125),
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.meshlab.flash_attention_4(q, k, v, True, 0.125)
    torch.library.opcheck(torch.ops.meshlab.flash_attention_4_backward.default,
                          (gout, q, k, v, out, lse, True, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_training_pass_takes_flash_attention_4_where_it_runs(monkeypatch):
    """Under ``torch.compile`` the training pass at head dims 64 and 128 takes
    ``meshlab::flash_attention_4`` where flash-attn-4 runs (the eager pass calls
    flash-attn-4 itself); inference, other head dims, a machine without it and native
    kernels turned off keep ``meshlab::attention``. (The device and compile state are
    posed: a CPU has neither.)"""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(attn_mod, "_cuda_half", lambda q: True)
    monkeypatch.setattr(attn_mod, "FA4_COMPILED", True)
    monkeypatch.setattr(attn_mod, "_flash_attn_4_backward", lambda: True)

    def takes(d=64, grad=True, fa4=True):
        monkeypatch.setattr(attn_mod, "_flash_attn_4_backward", lambda: True if fa4 else None)
        q, k, v = (torch.empty(2, h, 16, d, dtype=torch.bfloat16).requires_grad_(grad)
                   for h in (4, 2, 2))
        return attn_mod._compiled_fa4(q, k, v)

    assert takes() and takes(d=128)
    assert not takes(d=96) and not takes(grad=False) and not takes(fa4=False)
    with torch.no_grad():
        assert not takes()
    monkeypatch.setattr(attn_mod, "FA4_COMPILED", False)     # compiled blocks kept on cuDNN
    assert not takes()
    monkeypatch.setattr(attn_mod, "FA4_COMPILED", True)
    monkeypatch.setenv("MESHLAB_OPS_NATIVE", "0")
    assert not takes()


# ---------------------------------------------------------------------------- DTensor

def case_dtensor_attention(rank, world):
    """attention on DTensors sharded on batch or heads equals attention on the full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshlab.ops import _build, attention

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)                      # same global tensors everywhere
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 4, 37, 24), (2, 2, 37, 24),
                                                      (2, 2, 37, 24)))
    gout = torch.randn(2, 4, 37, 24, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, causal=True)
    want_g = torch.autograd.grad(want, full, gout)
    checked = []
    for layout, expect in (((Shard(0),) * 3, Shard(0)), ((Shard(1),) * 3, Shard(1)),
                           ((Replicate(),) * 3, Replicate()),
                           ((Shard(1), Replicate(), Replicate()), Shard(1))):
        dts = [distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip((q, k, v), layout)]
        out = attention(*dts, causal=True)
        assert out.placements == (expect,), (layout, out.placements)
        got_g = torch.autograd.grad(out, dts, distribute_tensor(gout, mesh, [expect]))
        torch.testing.assert_close(out.full_tensor(), want, rtol=1e-5, atol=1e-5)
        for a, e in zip(got_g, want_g):
            torch.testing.assert_close(a.full_tensor(), e, rtol=1e-5, atol=1e-5)
        checked.append(str(expect))
    assert _build.LAST_PATH[("attention", "cpu")].native or not _build.attention_cpu()
    return checked


def test_dtensor_sharded_equals_unsharded(world2):
    checked = world2.run(case_dtensor_attention)
    assert checked[0] == checked[1] == ["S(0)", "S(1)", "R", "S(1)"]


# ---------------------------------------------------------------------------- Hugging Face

def _llama(impl: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests._models import TINY

    kw = dict(TINY["llama"])
    # Weights large enough that attention matters to the logits (the default init is 0.02).
    cfg = AutoConfig.for_model(kw.pop("model_type"), initializer_range=0.5, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)


def test_hf_llama_matches_eager():
    assert register_hf() == register_hf() == "meshlab"                # idempotent
    eager, fused = _llama("eager"), _llama("meshlab")
    fused.load_state_dict(eager.state_dict())
    assert fused.config._attn_implementation == "meshlab"
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    _build.LAST_PATH.pop(("attention", "cpu"), None)
    want, got = eager(ids).logits, fused(ids).logits
    assert ("attention", "cpu") in _build.LAST_PATH                   # the bridge ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want.square().mean().backward()
    got.square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), fused.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-5 * a.grad.abs().max(), name
    # An all-ones padding mask is no mask; decoding one token at a time sees the whole cache.
    torch.testing.assert_close(fused(ids, attention_mask=torch.ones_like(ids)).logits, want,
                               rtol=1e-5, atol=1e-5)
    gen = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(fused.generate(ids[:1], **gen), eager.generate(ids[:1], **gen))


def test_hf_reads_padded_and_packed_masks_as_segments():
    """A left-padded row (attention_mask) and a row of two packed samples (position ids
    that start again): every token that is not padding gets SDPA's output."""
    register_hf()
    fused, ref = _llama("meshlab"), _llama("sdpa")
    ids = torch.randint(0, 97, (2, 9))
    pad = torch.ones_like(ids)
    pad[0, :2] = 0
    with torch.no_grad():
        got, want = (m(ids, attention_mask=pad).logits for m in (fused, ref))
        torch.testing.assert_close(got[pad.bool()], want[pad.bool()], rtol=1e-4, atol=1e-4)
        pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
        got, want = (m(ids[:1], position_ids=pos, use_cache=False).logits
                     for m in (fused, ref))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_causal_segments_of_masks():
    from meshlab.ops._attention_hf import causal_segments

    seg = torch.tensor([[0, 1, 2, 2, 2, 5, 5, 7]])
    tril = torch.ones(8, 8, dtype=torch.bool).tril()
    mask = ((seg[:, :, None] == seg[:, None, :]) & tril)[:, None]
    assert torch.equal(causal_segments(mask), seg)
    # right padding: the padding rows see the sample (transformers masks keys only)
    right = tril.clone()
    right[:, 6:] = False
    assert causal_segments(right[None, None]).tolist() == [[0, 0, 0, 0, 0, 0, 6, 7]]
    # a sliding window and a bidirectional mask are not causal within segments
    window = tril & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)
    assert causal_segments(window[None, None]) is None
    assert causal_segments(torch.ones(1, 1, 8, 8, dtype=torch.bool)) is None


def test_hf_refuses_what_it_cannot_do():
    register_hf()
    q, k, v = _inputs(2, 4, 2, 7, 7, 8, torch.float32)
    mod = types.SimpleNamespace(is_causal=True)
    window = torch.ones(7, 7, dtype=torch.bool).tril() & \
        ~torch.ones(7, 7, dtype=torch.bool).tril(-3)
    with pytest.raises(ConfigError, match="neither.*attn_implementation='sdpa'"):
        hf_attention(mod, q, k, v, window.expand(2, 1, 7, 7))
    with pytest.raises(ConfigError, match="no dropout"):
        hf_attention(mod, q, k, v, None, dropout=0.1)
    with pytest.raises(ConfigError, match="softcap"):
        hf_attention(mod, q, k, v, None, softcap=30.0)
    # Sparse attention's chosen keys and attention sinks were ignored (MiniMax-M3's
    # block_indices: logits 0.41 off transformers', no error); so would any other tensor
    # or float the op does not read be.
    for name, value in (("block_indices", torch.zeros(2, 4, 1, dtype=torch.long)),
                        ("indices", torch.zeros(2, 7, 2, dtype=torch.long)),
                        ("sinks", torch.zeros(4)), ("some_new_bias", torch.zeros(2, 4, 7, 7)),
                        ("logit_scale", 0.5)):
        with pytest.raises(ConfigError, match=f"does not support '{name}'"):
            hf_attention(mod, q, k, v, None, **{name: value})
    # What transformers passes beside that asks for nothing more (positions of a packed
    # batch, a flash kernel's lengths, flags) is accepted.
    out, _ = hf_attention(mod, q, k, v, None, position_ids=torch.arange(7)[None],
                          cu_seq_lens_q=torch.tensor([0, 7]), max_length_q=7,
                          output_attentions=False, sliding_window=None, block_indices=None)
    torch.testing.assert_close(out, attention(q, k, v, causal=True).transpose(1, 2))
    # A materialized mask that is exactly causal (bool, or additive float) is accepted.
    want = attention(q, k, v, causal=True).transpose(1, 2)
    tril = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 1, 7, 7)
    additive = torch.zeros(2, 1, 7, 7).masked_fill(~tril, torch.finfo(torch.float32).min)
    for mask in (tril, additive):
        out, weights = hf_attention(mod, q, k, v, mask)
        assert weights is None and out.shape == (2, 7, 4, 8) and out.is_contiguous()
        torch.testing.assert_close(out, want)
    # A causal module over a static cache's empty tail keeps the first S keys only.
    k_big, v_big = (torch.cat([t, torch.randn(2, 2, 5, 8)], dim=2) for t in (k, v))
    torch.testing.assert_close(hf_attention(mod, q, k_big, v_big, None)[0], want)
    # A non-causal module (an encoder) attends everywhere.
    enc = types.SimpleNamespace(is_causal=False)
    torch.testing.assert_close(hf_attention(enc, q, k, v, None)[0],
                               attention(q, k, v).transpose(1, 2))


def test_causal_mask_check_compiles_without_a_graph_break():
    """transformers passes an explicit causal mask under torch.compile; the check holds
    inside one graph (a device-side assertion) and still rejects other masks."""
    from meshlab.ops._attention_hf import _is_plain_causal

    s = 8
    causal = torch.zeros(1, 1, s, s).masked_fill(
        ~torch.ones(s, s, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    fn = torch.compile(lambda m: _is_plain_causal(m, s, s) and m.sum(), fullgraph=True,
                       backend="aot_eager")
    fn(causal)
    padded = causal.clone()
    padded[..., 0] = torch.finfo(torch.float32).min
    with pytest.raises(RuntimeError, match="not the plain causal"):
        fn(padded)


def test_ulysses_attention_refuses_what_its_sdpa_does_not_read():
    """Ulysses' SDPA took every keyword argument and read none but the mask, scale and
    dropout: an attention sink or a sparse attention's indices were dropped unseen."""
    from meshlab.transforms.sequence import _ulysses

    q, k, v = _inputs(2, 4, 2, 7, 7, 8, torch.float32)
    mod = types.SimpleNamespace(is_causal=True)
    for name, value in (("s_aux", torch.zeros(4)), ("indices", torch.zeros(2, 7, 2)),
                        ("softcap", 30.0)):
        with pytest.raises(ConfigError, match=f"all_to_all.*does not support '{name}'.*"
                                              f"Megatron SP"):
            _ulysses.attention(mod, q, k, v, None, **{name: value})
