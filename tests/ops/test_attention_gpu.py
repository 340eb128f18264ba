"""meshlab::attention on a CUDA device: the path taken (flash-attn, cuDNN SDPA or the
memory-efficient kernel, with the reason recorded), forward and gradients against the
float32 reference in bfloat16 and float32, causal or not, grouped-query, and opcheck."""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _mod():
    import meshlab.ops  # noqa: F401  (registers the ops)

    return sys.modules["meshlab.ops.attention"]


def _cuda():
    """The module of the CUDA kernels' calls (cuDNN, memory-efficient), to patch them."""
    import meshlab.ops  # noqa: F401

    return sys.modules["meshlab.ops._attention_cuda"]


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(b, hq, hkv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(device="cuda", dtype=dtype)
            for shape in ((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d))]


def _fwd_bwd(fn, q, k, v, gout=None, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    gout = torch.randn_like(out) if gout is None else gout
    return (out, *torch.autograd.grad(out, leaves, gout)), gout


def _compare(fn, q, k, v, causal, scale=None):
    from meshlab.ops import attention_reference

    got, gout = _fwd_bwd(fn, q, k, v, causal=causal, scale=scale)
    want, _ = _fwd_bwd(attention_reference, q, k, v, gout, causal=causal, scale=scale)
    errs = {n: _rel(a, e) for n, a, e in zip(("out", "dq", "dk", "dv"), got, want)}
    assert all(e < TOL[q.dtype] for e in errs.values()), errs
    assert all(a.dtype == q.dtype and a.shape == e.shape for a, e in zip(got, want))


def _op(q, k, v, causal=False, scale=None):
    """The custom op itself, bypassing the flash-attn shortcut of attention()."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.meshlab.attention(q, k, v, causal, scale)[0]


SHAPES = [(2, 4, 2, 37, 24), (1, 8, 1, 130, 64), (2, 4, 4, 64, 128)]   # (B, Hq, Hkv, S, D)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_custom_op_matches_reference(dtype, shape, causal):
    from meshlab.ops import _build

    q, k, v = _inputs(*shape, dtype)
    _compare(_op, q, k, v, causal)
    for op in ("attention", "attention_backward"):
        path = _build.LAST_PATH[(op, "cuda")]
        assert path.native, path
        if dtype == torch.bfloat16:
            assert path.reason.startswith("cuDNN SDPA"), path        # H100/H200: sm90
        else:
            assert path.reason.startswith("memory-efficient SDPA") and "float32" in path.reason, \
                path


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_public_attention_path(causal):
    """attention() takes flash-attn when it is installed, the custom op otherwise."""
    from meshlab.ops import _build, attention

    q, k, v = _inputs(2, 8, 2, 257, 64, torch.bfloat16)
    _compare(attention, q, k, v, causal, scale=0.1)
    path = _build.LAST_PATH[("attention", "cuda")]
    fa, fa4 = _mod()._flash_attn(), _mod()._flash_attn_4()
    if fa4 is not None:                 # a training pass at head dim 64
        assert path.reason == f"flash-attn-4 {fa4[1]} (training pass)", path
    elif fa is not None:
        assert path.reason == f"flash-attn {fa.__version__}", path
    else:
        assert path.reason.startswith("cuDNN SDPA"), path


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_4_takes_the_training_pass(d, causal):
    """Where flash-attn-4 is installed on a Hopper card, a pass that records a graph runs
    on it (forward and backward within bf16 rounding of the float32 reference, grouped
    heads as they are); a forward without a graph stays on cuDNN, its faster forward."""
    from meshlab.ops import _build, attention

    if _mod()._flash_attn_4() is None:
        pytest.skip("flash-attn-4 is not installed, or this is not a Hopper card")
    q, k, v = _inputs(2, 8, 2, 256, d, torch.bfloat16)
    _compare(attention, q, k, v, causal)
    assert _build.LAST_PATH[("attention", "cuda")].reason.startswith("flash-attn-4"), \
        _build.LAST_PATH[("attention", "cuda")]
    with torch.no_grad():
        attention(q, k, v, causal=causal)
    assert not _build.LAST_PATH[("attention", "cuda")].reason.startswith("flash-attn-4")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiled_training_pass_takes_flash_attn_4(d, causal, monkeypatch):
    """Under ``torch.compile`` the training pass runs flash-attn-4 through
    ``meshlab::flash_attention_4`` (no graph break), with Hugging Face's (B, S, H, D)
    projections transposed: forward and gradients within bf16 rounding of the float32
    reference, and within flash-attn-4's own eager pass's to its run-to-run spread."""
    from meshlab.ops import _build, attention

    if _mod()._flash_attn_4_backward() is None:
        pytest.skip("flash-attn-4 is not installed, or this is not a Hopper card")
    monkeypatch.setattr(_mod(), "FA4_COMPILED", True)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)     # (B, S, H, D) memory
               for t in _inputs(2, 8, 2, 256, d, torch.bfloat16))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, causal, scale=None:
                             attention(q, k, v, causal=causal, scale=scale), fullgraph=True)
    _compare(compiled, q, k, v, causal)
    assert _build.LAST_PATH[("attention", "cuda")].reason.endswith("(training pass, compiled)"), \
        _build.LAST_PATH[("attention", "cuda")]
    got, gout = _fwd_bwd(compiled, q, k, v, causal=causal)
    want, _ = _fwd_bwd(attention, q, k, v, gout, causal=causal)
    again, _ = _fwd_bwd(attention, q, k, v, gout, causal=causal)
    errs = {n: _rel(a, e) for n, a, e in zip(("out", "dq", "dk", "dv"), got, want)}
    # flash-attn-4's backward accumulates dq (and grouped dk, dv) with atomics: its own
    # eager pass differs from run to run by rounding, the bound the compiled pass gets too
    spread = {n: _rel(a, e) for n, a, e in zip(("out", "dq", "dk", "dv"), again, want)}
    print("compiled against eager flash-attn-4:", errs, "eager against itself:", spread)
    assert all(errs[n] <= max(1e-3, 4 * spread[n]) for n in errs), (errs, spread)
    # flash-attn-4's layout, (B, S, H, D) memory, is what comes back: nothing copied
    bshd = [t.transpose(1, 2).is_contiguous() for t in got]
    assert all(bshd), [(t.shape, t.stride()) for t in got]


def test_lse_matches_reference():
    mod = _mod()
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = _inputs(2, 4, 2, 37, 24, dtype)
        _, lse = torch.ops.meshlab.attention(q, k, v, True, 0.3)
        want = torch.logsumexp(mod._scores(q, k, True, 0.3), -1)
        assert lse.shape == (2, 4, 37) and lse.dtype == torch.float32 and lse.is_contiguous()
        torch.testing.assert_close(lse, want, rtol=1e-3, atol=1e-3)


def test_memory_efficient_path_in_bf16(monkeypatch):
    """With cuDNN ruled out, bf16 runs the memory-efficient kernel (lse rows padded to 32)."""
    from meshlab.ops import _build

    monkeypatch.setattr(_cuda(), "_cudnn_unusable", lambda q, causal: "cuDNN SDPA ruled out")
    q, k, v = _inputs(2, 4, 2, 37, 24, torch.bfloat16)
    _compare(_op, q, k, v, True)
    path = _build.LAST_PATH[("attention", "cuda")]
    assert path.reason == "memory-efficient SDPA, as cuDNN SDPA ruled out", path


def test_cudnn_refusal_is_recorded_and_remembered(monkeypatch):
    from meshlab.ops import _build

    mod = _cuda()
    calls = []

    def refuse(*args):
        calls.append(1)
        raise RuntimeError("cuDNN Frontend error: no engine for this graph\nmore detail")

    monkeypatch.setattr(mod, "_cudnn_fwd", refuse)
    monkeypatch.setattr(mod, "_CUDNN_REFUSED", {})
    q, k, v = _inputs(1, 2, 2, 16, 40, torch.bfloat16)
    for _ in range(2):
        _op(q, k, v, causal=True)
        path = _build.LAST_PATH[("attention", "cuda")]
        assert path.native and path.reason.startswith(
            "memory-efficient SDPA, as cuDNN SDPA raised cuDNN Frontend error"), path
    assert len(calls) == 1                       # the second call did not ask cuDNN again


def test_native_off_runs_reference(monkeypatch):
    from meshlab.ops import _build

    monkeypatch.setenv("MESHLAB_OPS_NATIVE", "0")
    q, k, v = _inputs(1, 4, 2, 33, 24, torch.bfloat16)
    _compare(_op, q, k, v, True)
    for op in ("attention", "attention_backward"):
        path = _build.LAST_PATH[(op, "cuda")]
        assert not path.native and path.reason == "MESHLAB_OPS_NATIVE=0", path


def test_long_causal_gqa_bf16():
    """Llama-3-8B's attention shape (32 query heads on 8 kv heads of 128), 2048 tokens."""
    q, k, v = _inputs(1, 32, 8, 2048, 128, torch.bfloat16)
    _compare(_op, q, k, v, True)


def test_opcheck_cuda():
    from meshlab.ops import check as _check

    row = _check.check_op("attention", "cuda", dtypes=("bfloat16",), run_opcheck=True,
                          small=True)
    assert not row.failures, row.failures


@pytest.mark.parametrize("causal", [True, False])
def test_custom_op_gradients_with_hugging_face_layouts(causal):
    """The custom op (what torch.compile runs) on q/k/v that are transposes of (B, S, H, D)
    projections, with the output gradient laid out the same way, as Hugging Face hands them
    over (a contiguous out with a strided dout is a mix cuDNN's backward once turned into
    wrong gradients without an error; out now keeps the queries' layout)."""
    mod = _mod()
    b, s, hq, hkv, d = 2, 64, 8, 2, 64
    g = torch.Generator().manual_seed(3)

    def bshd(h):
        return torch.randn(b, s, h, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)

    q, k, v = bshd(hq), bshd(hkv), bshd(hkv)
    gout = bshd(hq)
    scale = d ** -0.5
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch.ops.meshlab.attention(*leaves, causal, scale)[0]
    got = torch.autograd.grad(out, leaves, gout)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = mod.attention_reference(*ref_leaves, causal=causal, scale=scale)
    want = torch.autograd.grad(ref, ref_leaves, gout.float())
    assert _rel(out, ref) < TOL[torch.bfloat16]
    for name, a, w in zip("qkv", got, want):
        assert _rel(a, w) < TOL[torch.bfloat16], name
    # outputs in their inputs' layouts: the transposes back to (B, S, H * D) are views
    assert out.stride() == q.stride()
    assert [a.stride() for a in got] == [q.stride(), k.stride(), v.stride()]


def _small_llama(vocab: int, dtype: torch.dtype):
    """A two-layer Llama on CUDA (hidden 256, 4 heads on 2 kv heads), seeded."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="sdpa",
                                   use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).to(dtype)


def test_compiled_fused_llama_trains_like_eager():
    """fuse_model then torch.compile on CUDA: the losses of four AdamW steps equal the eager
    fused model's (within bf16 rounding)."""
    import copy

    from meshlab.transforms.fuse import causal_lm_loss, fuse_model

    base = _small_llama(1024, torch.bfloat16)
    ids = torch.randint(0, 1024, (4, 128), device="cuda")

    def train(compiled: bool) -> list[float]:
        m = copy.deepcopy(base)
        fuse_model(m)
        run = torch.compile(m) if compiled else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        out = []
        for _ in range(4):
            loss = causal_lm_loss(run, {"input_ids": ids})
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(float(loss.detach()))
        return out

    eager, compiled = train(False), train(True)
    assert eager[-1] < eager[0] - 0.5
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=5e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_llama_gradients_on_cuda(dtype):
    """fuse_model on CUDA (the layers' sums inside the norms' Triton backward and the
    query/key/value products, cuDNN or the reference attention): loss and every gradient
    those of the unrouted model, to float32 rounding in float32 and bf16 rounding in bf16."""
    import copy

    import meshlab as ml
    from meshlab.ops import _build
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model

    ref = _small_llama(512, dtype)
    model = copy.deepcopy(ref)
    assert fuse_model(model).counts()["residual_add"] == 2
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    want = ml.losses.causal_lm_loss(ref(input_ids=ids), batch)
    want.backward()
    _build.LAST_PATH.clear()
    got = causal_lm_loss(model, batch)
    got.backward()
    assert _build.LAST_PATH[("rms_norm_backward", "cuda")].reason.startswith("Triton")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        rel = float((p.grad.float() - refp[n].grad.float()).norm()
                    / refp[n].grad.float().norm())
        assert rel < (1e-3 if dtype == torch.float32 else 3e-2), (n, rel)


def _segments(b, s, device="cuda"):
    """Row 0: three padding tokens (each its own segment), then one sample; row 1: two
    packed samples, then padding (each token its own)."""
    seg = torch.empty(b, s, dtype=torch.long)
    seg[0, :3], seg[0, 3:] = torch.arange(3), 3
    n = s // 3
    seg[1, :n], seg[1, n:s - 2], seg[1, s - 2:] = 0, n, torch.arange(s - 2, s)
    return seg[:2].repeat(-(-b // 2), 1)[:b].to(device)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_segment_masked_op_matches_reference(dtype, causal):
    """The custom op with segment ids (the memory-efficient kernel with the mask as a bias):
    forward, lse and gradients against the float32 reference."""
    mod = _mod()
    q, k, v = (t.requires_grad_() for t in _inputs(2, 4, 2, 96, 64, dtype))
    seg = _segments(2, 96)
    out, lse = torch.ops.meshlab.attention(q, k, v, causal, 0.125, seg, seg)
    assert "segment" in mod._build.LAST_PATH[("attention", "cuda")].reason
    ref = mod.attention_reference(q.float(), k.float(), v.float(), causal, 0.125, seg)
    assert _rel(out, ref) < TOL[dtype]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.float())
    for a, b in zip(got, want):
        assert _rel(a, b) < 2 * TOL[dtype]


@pytest.mark.parametrize("d", [64, 128])
def test_segments_take_flash_attention_varlen(d):
    """With flash-attn (4 on Hopper, else 2) installed, a causal segment-masked training
    pass runs its varlen function, one sequence a segment, and matches the reference."""
    mod = _mod()
    if mod._flash_attn() is None and mod._flash_attn_4() is None:
        pytest.skip("flash-attn is not installed")
    q, k, v = (t.requires_grad_() for t in _inputs(2, 4, 2, 128, d, torch.bfloat16))
    seg = _segments(2, 128)
    out = mod.attention(q, k, v, causal=True, segments=seg)
    assert "varlen" in mod._build.LAST_PATH[("attention", "cuda")].reason
    ref = mod.attention_reference(q.float(), k.float(), v.float(), True, None, seg)
    assert _rel(out, ref) < 1e-2
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g),
                    torch.autograd.grad(ref, (q, k, v), g.float())):
        assert _rel(a, b) < 2e-2
