"""Every ``meshlab::`` op, forward and backward, on the input layouts models hand it:
contiguous, transposed (queries and keys as Hugging Face lays them out, ``view(B, S, H, D)
.transpose(1, 2)``, and their gradients), sliced (a chunk of a packed qkv or gate/up
projection, the first half of a cos/sin table), expanded (stride-0 broadcasts) and a decoding
step whose size-1 dim carries an odd stride. Attention also takes segment ids (packed and
padded rows): contiguous int64, and a strided int32 view (a column of a wider table).

For each: ``torch.library.opcheck`` (the fake kernel against the real one, autograd, AOT
dispatch); the outputs' sizes and strides equal between the real and the fake kernel on
every dim, size-1 dims too, which opcheck and inductor's stride asserts skip; and the numbers
against the un-fused PyTorch math. The rule real and fake kernels follow: each output is a
fresh contiguous tensor, whatever its inputs' strides; except, on CUDA, the attention's
output and gradients, which take their inputs' layouts as cuDNN writes them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from meshlab.ops import _build  # importing meshlab.ops registers the meshlab:: ops
from meshlab.ops import (attention_reference, layer_norm_reference, rms_norm_reference,
                         rotary_reference, swiglu_reference, geglu_reference)

pytestmark = pytest.mark.timeout(120)

B, S, H, D = 2, 8, 4, 16          # batch, sequence, heads, head dim
HKV = 2                           # kv heads (grouped-query attention)
HID = 32                          # hidden size of the norms and the gate
TOL = dict(rtol=1e-4, atol=1e-5)


def _r(*shape):
    return torch.randn(*shape)


@dataclass
class Case:
    """One op on one layout: ``args`` for ``op``; ``grad_idx`` the inputs opcheck gives
    ``requires_grad``; ``want(*args)`` the reference outputs, in the op's output order."""

    op: Callable
    args: tuple
    grad_idx: tuple[int, ...]
    want: Callable


def _vjp(fn, args, idx, gout):
    """Gradients of ``fn(*args)`` against ``gout`` for the inputs at ``idx`` (reference math)."""
    leaves = [a.detach().requires_grad_(i in idx) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    return torch.autograd.grad(fn(*leaves), [leaves[i] for i in idx], gout)


# ---------------------------------------------------------------------------- layouts

def _heads(layout: str, h: int, s: int = S) -> torch.Tensor:
    """A (B, S, h, D) tensor laid out as ``layout``."""
    return {
        "contiguous": lambda: _r(B, s, h, D),
        # (B, h, S, D) memory seen as (B, S, h, D): a gradient coming back from attention.
        "transposed": lambda: _r(B, h, s, D).transpose(1, 2),
        # The query heads of a packed (B, S, h + 2 HKV, D) projection.
        "sliced": lambda: _r(B, s, h + 2 * HKV, D)[:, :, :h],
        "expanded": lambda: _r(1, s, h, D).expand(B, s, h, D),
    }[layout]()


def _rows(layout: str, h: int = HID) -> torch.Tensor:
    """A (B, S, h) activation laid out as ``layout``."""
    return {
        "contiguous": lambda: _r(B, S, h),
        "transposed": lambda: _r(S, B, h).transpose(0, 1),
        "sliced": lambda: _r(B, S, 2 * h)[..., :h],           # one half of a packed projection
        "expanded": lambda: _r(1, S, h).expand(B, S, h),
        "hidden_major": lambda: _r(B, h, S).transpose(1, 2),  # the reduced dim is strided
    }[layout]()


# ---------------------------------------------------------------------------- rotary

def _rotary(layout: str) -> list[Case]:
    s = 1 if layout == "decode" else S
    ang = _r(s, D // 2)
    cos, sin = ang.cos(), ang.sin()
    if layout == "decode":
        # One query: (B, H, 1, D) from Hugging Face's transpose, (B, 1, H, D) here; contiguous
        # by is_contiguous(), with the size-1 dim's stride D, not H * D.
        x = _r(B, H, 1, D).transpose(1, 2)
    elif layout == "hf_tables":
        # Hugging Face's (S, D) tables with equal halves, of which fuse() passes [:, :D/2].
        x = _heads("transposed", H)
        cos, sin = torch.cat([cos, cos], -1)[:, :D // 2], torch.cat([sin, sin], -1)[:, :D // 2]
    elif layout == "expanded":
        x = _heads("expanded", H)
        cos, sin = cos[:1].expand(S, D // 2), sin[:1].expand(S, D // 2)
    else:
        x = _heads(layout, H)
    return [Case(torch.ops.meshlab.rotary.default, (x, cos, sin), (0,),
                 lambda x, c, sn: (rotary_reference(x, c, sn),))]


# ---------------------------------------------------------------------------- norms

def _weight(layout: str) -> torch.Tensor:
    # A strided weight (every other element of a longer vector) goes with the sliced layout.
    return _r(2 * HID)[::2] if layout == "sliced" else _r(HID)


def _rms_norm(layout: str) -> list[Case]:
    x, w, eps = _rows(layout), _weight(layout), 1e-6
    _, rstd = torch.ops.meshlab.rms_norm(x, w, eps)
    dy = _rows(layout)

    def want_fwd(x, w, eps):
        xf = x.float()
        return rms_norm_reference(x, w, eps), torch.rsqrt(xf.pow(2).mean(-1) + eps)

    return [Case(torch.ops.meshlab.rms_norm.default, (x, w, eps), (0, 1), want_fwd),
            Case(torch.ops.meshlab.rms_norm_backward.default, (dy, x, w, rstd), (),
                 lambda dy, x, w, rstd: _vjp(rms_norm_reference, (x, w, eps), (0, 1), dy))]


def _add_rms_norm(layout: str) -> list[Case]:
    x, r, w, eps = _rows(layout), _rows(layout), _weight(layout), 1e-6
    _, total, rstd = torch.ops.meshlab.add_rms_norm(x, r, w, eps)
    dy, ds = _rows(layout), _rows(layout)

    def want_fwd(x, r, w, eps):
        s = x + r
        return (rms_norm_reference(s, w, eps), s,
                torch.rsqrt(s.float().pow(2).mean(-1) + eps))

    def want_bwd(dy, ds, total, w, rstd):
        dx, dw = _vjp(rms_norm_reference, (total, w, eps), (0, 1), dy)
        return dx + ds, dw

    return [Case(torch.ops.meshlab.add_rms_norm.default, (x, r, w, eps), (0, 1, 2), want_fwd),
            Case(torch.ops.meshlab.add_rms_norm_backward.default, (dy, ds, total, w, rstd),
                 (), want_bwd)]


def _layer_norm(layout: str) -> list[Case]:
    x, w, b, eps = _rows(layout), _weight(layout), _r(HID), 1e-5
    _, mean, rstd = torch.ops.meshlab.layer_norm(x, w, b, eps)
    dy = _rows(layout)

    def want_fwd(x, w, b, eps):
        xf = x.float()
        return (layer_norm_reference(x, w, b, eps), xf.mean(-1),
                torch.rsqrt(xf.var(-1, unbiased=False) + eps))

    def want_bwd(dy, x, w, mean, rstd):
        return _vjp(layer_norm_reference, (x, w, b, eps), (0, 1, 2), dy)

    return [Case(torch.ops.meshlab.layer_norm.default, (x, w, b, eps), (0, 1, 2), want_fwd),
            Case(torch.ops.meshlab.layer_norm_backward.default, (dy, x, w, mean, rstd), (),
                 want_bwd)]


# ---------------------------------------------------------------------------- swiglu

def _gated(layout: str, name: str = "swiglu") -> list[Case]:
    ref = swiglu_reference if name == "swiglu" else geglu_reference
    ops = [getattr(torch.ops.meshlab, name + end).default
           for end in ("", "_backward", "_backward_y")]
    if layout == "sliced":
        a, b = _r(B, S, 2 * HID).chunk(2, dim=-1)      # a packed gate/up projection
        dy = _rows("transposed")
    else:
        a, b, dy = _rows(layout), _rows(layout), _rows(layout)
    return [Case(ops[0], (a, b), (0, 1), lambda a, b: (ref(a, b),)),
            Case(ops[1], (dy, a, b), (), lambda dy, a, b: _vjp(ref, (a, b), (0, 1), dy)),
            Case(ops[2], (dy, a, b), (),
                 lambda dy, a, b: (*_vjp(ref, (a, b), (0, 1), dy), ref(a, b)))]


def _mm_sum(layout: str) -> list[Case]:
    """Two products summed (the gradient reaching one input through two linear maps)."""
    def mat(m, n):
        return {"contiguous": lambda: _r(m, n), "transposed": lambda: _r(n, m).t(),
                "sliced": lambda: _r(m, 2 * n)[:, :n]}[layout]()
    a, b, c, d = mat(6, 4), mat(4, 5), mat(6, 3), mat(3, 5)
    return [Case(torch.ops.meshlab.mm_sum.default, ([a, c], [b, d]), (),
                 lambda x, y: (x[0] @ y[0] + x[1] @ y[1],))]


# ---------------------------------------------------------------------------- attention

def _qkv(layout: str):
    """q (B, H, S, D), k, v (B, HKV, S, D) laid out as ``layout``, and whether causal."""
    if layout == "decode":
        # One new query over a cache of S keys: q's size-1 dim has stride H * D, not D.
        q = _r(B, 1, H, D).transpose(1, 2)
        return q, _r(B, HKV, S, D), _r(B, HKV, S, D), False
    if layout == "sliced":
        # Hugging Face's fused qkv projection: one (B, S, (H + 2 HKV) D) matrix, split.
        qkv = _r(B, S, (H + 2 * HKV) * D)
        q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
        t = [x.view(B, S, -1, D).transpose(1, 2) for x in (q, k, v)]
        return t[0], t[1], t[2], True
    if layout == "expanded":
        q = _r(1, H, S, D).expand(B, H, S, D)
        return q, _r(1, HKV, S, D).expand(B, HKV, S, D), _r(B, HKV, S, D), True
    if layout == "transposed":                                 # view(B, S, H, D).transpose
        return (_r(B, S, H, D).transpose(1, 2), _r(B, S, HKV, D).transpose(1, 2),
                _r(B, S, HKV, D).transpose(1, 2), True)
    return _r(B, H, S, D), _r(B, HKV, S, D), _r(B, HKV, S, D), True


def _segment_ids(layout: str):
    """Segment ids (B, S) of a padded row (two padding tokens, each its own segment, then a
    sample) and a packed one (two samples, then a padding token), or None. ``segments``:
    contiguous int64; ``segments_strided``: int32, a column of a (B, S, 2) table."""
    if not layout.startswith("segments"):
        return None
    seg = torch.tensor([[0, 1, 2, 2, 2, 2, 2, 2], [0, 0, 0, 3, 3, 3, 3, 7]])
    if layout == "segments_strided":
        return torch.stack([seg, -seg], -1).to(torch.int32)[..., 0]
    return seg


def _attention(layout: str, name: str = "attention") -> list[Case]:
    q, k, v, causal = _qkv("contiguous" if layout == "segments" else
                           "transposed" if layout == "segments_strided" else layout)
    seg = _segment_ids(layout)
    scale = D ** -0.5
    segs = () if seg is None else (seg, seg)
    out, lse = torch.ops.meshlab.attention(q, k, v, causal, scale, *segs)
    # The gradient of out.transpose(1, 2), as the attention module's o_proj hands it back.
    dout = _r(B, q.shape[2], H, D).transpose(1, 2)

    def want_fwd(q, k, v, causal, scale, *segs):
        s = q.float() @ k.float().repeat_interleave(H // HKV, 1).transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
        if segs:
            s = s.masked_fill(segs[0][:, None, :, None] != segs[1][:, None, None, :],
                              -torch.inf)
        return attention_reference(q, k, v, causal, scale, *segs), torch.logsumexp(s, -1)

    def want_bwd(dout, q, k, v, out, lse, causal, scale, *segs):
        return _vjp(lambda q, k, v: attention_reference(q, k, v, causal, scale, *segs),
                    (q, k, v), (0, 1, 2), dout)

    fwd, bwd = getattr(torch.ops.meshlab, name), getattr(torch.ops.meshlab, f"{name}_backward")
    return [Case(fwd.default, (q, k, v, causal, scale, *segs), (0, 1, 2), want_fwd),
            Case(bwd.default, (dout, q, k, v, out, lse, causal, scale, *segs), (), want_bwd)]


# ---------------------------------------------------------------------------- loss head

def _linear_cross_entropy(layout: str) -> list[Case]:
    n, vocab = B * S, 24
    hidden = {"contiguous": lambda: _r(n, HID),
              "transposed": lambda: _r(HID, n).t(),
              "sliced": lambda: _r(n, 2 * HID)[:, :HID],
              "expanded": lambda: _r(1, HID).expand(n, HID)}[layout]()
    # A tied head's weight is the embedding's; transposed, it is a (H, V) matrix's .t().
    weight = _r(HID, vocab).t() if layout == "transposed" else _r(vocab, HID)
    target = torch.randint(0, vocab, (2 * n,))[::2] if layout == "sliced" else \
        torch.randint(0, vocab, (n,))
    target[1] = -100

    def want(h, w, t, ignore, chunk, with_grad):
        def loss(h, w):
            return F.cross_entropy(h.float() @ w.float().T, t, ignore_index=ignore,
                                   reduction="sum")
        gh, gw = _vjp(loss, (h, w), (0, 1), torch.tensor(1.0))
        return loss(h, w), (t != ignore).sum().float(), gh, gw

    return [Case(torch.ops.meshlab.linear_cross_entropy.default,
                 (hidden, weight, target, -100, 5, True), (0, 1), want)]


# ---------------------------------------------------------------------------- decoding

def _paged_attention(layout: str) -> list[Case]:
    from meshlab.ops.paged_attention import layout as paged_layout, paged_attention_reference

    bs, blocks = 4, 12
    kc, vc = _r(blocks, bs, HKV, D), _r(blocks, bs, HKV, D)
    tables = torch.tensor([[5, 2, 9], [0, 7, 3]], dtype=torch.int32)
    # decode: one new token per sequence; else a prompt being filled beside a decode
    lens, starts = ([10, 7], [0, 1, 2]) if layout == "decode" else ([10, 7], [0, 6, 7])
    t = starts[-1]
    q = {"contiguous": lambda: _r(t, H, D), "decode": lambda: _r(t, H, D),
         # what the attention interface hands over: (1, H, T, D)[0].transpose(0, 1)
         "transposed": lambda: _r(1, H, t, D)[0].transpose(0, 1)}[layout]()
    where = paged_layout(tables, lens, starts, bs)

    def want(q, kc, vc, *_):
        return (paged_attention_reference(q, kc, vc, tables, lens, starts, D ** -0.5),)

    return [Case(torch.ops.meshlab.paged_attention.default,
                 (q, kc, vc, where.tables, where.seq, where.row, where.mask, where.keys,
                  D ** -0.5), (),
                 want)]


def _paged_decode(layout: str) -> list[Case]:
    """A decode step that stores its keys and values and attends (one query a sequence);
    ``strided``: the queries, keys and values are parts of one merged product's rows."""
    from meshlab.ops.paged_attention import layout as paged_layout, paged_attention_reference

    bs, blocks = 4, 12
    kc, vc = _r(blocks, bs, HKV, D), _r(blocks, bs, HKV, D)
    tables = torch.tensor([[5, 2, 9], [0, 7, 3]], dtype=torch.int32)
    lens, starts = [10, 7], [0, 1, 2]
    slots = torch.tensor([9 * bs + 1, 7 * bs + 2])          # each sequence's last key
    if layout == "strided":
        row = _r(2, (H + 2 * HKV) * D)
        q = row[:, :H * D].view(2, H, D)
        k, v = row[:, H * D:(H + HKV) * D].view(2, HKV, D), row[:, (H + HKV) * D:].view(2, HKV, D)
    else:
        q, k, v = _r(2, H, D), _r(2, HKV, D), _r(2, HKV, D)
    where = paged_layout(tables, lens, starts, bs)

    def want(q, kc, vc, tables_, seq, keys, scale, k, v, slots):
        kw, vw = kc.clone(), vc.clone()
        kw.view(-1, HKV, D)[slots] = k
        vw.view(-1, HKV, D)[slots] = v
        return (paged_attention_reference(q, kw, vw, tables, lens, starts, D ** -0.5),)

    return [Case(torch.ops.meshlab.paged_decode.default,
                 (q, kc, vc, where.tables, where.seq, where.keys, D ** -0.5, k, v, slots), (),
                 want)]


# ---------------------------------------------------------------------------- the checks

BUILDERS = {"rotary": (_rotary, ("contiguous", "transposed", "sliced", "hf_tables",
                                 "expanded", "decode")),
            "rms_norm": (_rms_norm, ("contiguous", "transposed", "sliced", "expanded",
                                     "hidden_major")),
            "add_rms_norm": (_add_rms_norm, ("contiguous", "transposed", "sliced",
                                             "expanded", "hidden_major")),
            "layer_norm": (_layer_norm, ("contiguous", "transposed", "sliced", "expanded",
                                         "hidden_major")),
            "swiglu": (_gated, ("contiguous", "transposed", "sliced", "expanded")),
            "geglu": (lambda layout: _gated(layout, "geglu"),
                      ("contiguous", "transposed", "sliced", "expanded")),
            "attention": (_attention, ("contiguous", "transposed", "sliced", "expanded",
                                       "decode", "segments", "segments_strided")),
            # flash-attn-4's ops, where it does not run: the same math on meshlab's kernels
            "flash_attention_4": (lambda layout: _attention(layout, "flash_attention_4"),
                                  ("contiguous", "transposed", "sliced", "expanded",
                                   "decode")),
            "linear_cross_entropy": (_linear_cross_entropy, ("contiguous", "transposed",
                                                             "sliced", "expanded")),
            "paged_attention": (_paged_attention, ("contiguous", "transposed", "decode")),
            "paged_decode": (_paged_decode, ("contiguous", "strided")),
            "mm_sum": (_mm_sum, ("contiguous", "transposed", "sliced"))}
PARAMS = [(op, layout) for op, (_, layouts) in BUILDERS.items() for layout in layouts]


def _cases(op: str, layout: str) -> list[Case]:
    torch.manual_seed(0)
    return BUILDERS[op][0](layout)


def _fake_run(op, args):
    """``op`` on fake copies of ``args`` (same sizes, strides and offsets): the fake kernel."""
    with FakeTensorMode() as mode:
        def fake(a):
            if isinstance(a, (list, tuple)):        # a Tensor[] argument
                return type(a)(fake(x) for x in a)
            return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
        return op(*[fake(a) for a in args])


def _outs(res) -> tuple:
    return (res,) if isinstance(res, torch.Tensor) else tuple(res)


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.storage_offset()


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    """Random values of ``t``'s shape in transposed memory (as gradients often arrive)."""
    if t.dim() < 2:
        return torch.randn_like(t)
    return torch.randn(t.shape[1], t.shape[0], *t.shape[2:], dtype=t.dtype).transpose(0, 1)


def test_every_op_is_covered():
    """Every registered meshlab:: op has cases here: a new op must add its layouts."""
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("meshlab::")}
    covered = {c.op.name().split("::")[1] for op, (_, layouts) in BUILDERS.items()
               for c in _cases(op, layouts[0])}
    assert names and names <= covered, sorted(names - covered)


@pytest.mark.parametrize("op,layout", PARAMS, ids=[f"{o}-{lay}" for o, lay in PARAMS])
def test_opcheck(op, layout):
    for case in _cases(op, layout):
        args = tuple(a.detach().requires_grad_(i in case.grad_idx)
                     if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for i, a in enumerate(case.args))
        torch.library.opcheck(case.op, args)


@pytest.mark.parametrize("path", ["kernel", "fallback"])
@pytest.mark.parametrize("op,layout", PARAMS, ids=[f"{o}-{lay}" for o, lay in PARAMS])
def test_fake_and_real_agree_on_every_stride(op, layout, path):
    """The kernels' outputs and the PyTorch fallback's (which computes with the inputs'
    strides) both have the fake's sizes and strides, size-1 dims included."""
    for case in _cases(op, layout):
        with _build.force_reference() if path == "fallback" else contextlib.nullcontext():
            real = _outs(case.op(*case.args))
        fake = _outs(_fake_run(case.op, case.args))
        assert len(real) == len(fake), case.op.name()
        for i, (r, f) in enumerate(zip(real, fake)):
            assert _meta(r) == _meta(f), (case.op.name(), i, _meta(r), _meta(f))
            assert r.numel() == 0 or r.is_contiguous(), (case.op.name(), i, r.stride())
            assert r.stride() == torch.empty(r.shape).stride(), (case.op.name(), i)


@pytest.mark.parametrize("op,layout", PARAMS, ids=[f"{o}-{lay}" for o, lay in PARAMS])
def test_numerics_against_reference(op, layout):
    for case in _cases(op, layout):
        got, want = _outs(case.op(*case.args)), case.want(*case.args)
        assert len(got) == len(want), case.op.name()
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w.to(g.dtype), **TOL,
                                       msg=lambda m: f"{case.op.name()} output {i}: {m}")


@pytest.mark.parametrize("op,layout", PARAMS, ids=[f"{o}-{lay}" for o, lay in PARAMS])
def test_gradients_against_reference(op, layout):
    """Through each forward op's autograd (its backward op, or for rotary the same op by
    the opposite angle), with the output's gradient in transposed memory."""
    for case in _cases(op, layout):
        if not case.grad_idx:
            continue
        leaves = [a.detach().requires_grad_(i in case.grad_idx)
                  if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                  for i, a in enumerate(case.args)]
        out = _outs(case.op(*leaves))[0]
        gout = _strided_like(out)
        got = torch.autograd.grad(out, [leaves[i] for i in case.grad_idx], gout)
        want = _vjp(lambda *a: case.want(*a)[0], case.args, case.grad_idx, gout)
        for i, (g, w) in zip(case.grad_idx, zip(got, want)):
            torch.testing.assert_close(g, w.to(g.dtype), **TOL,
                                       msg=lambda m: f"{case.op.name()} grad {i}: {m}")


def test_like_copies_only_another_layout():
    """``_build.like``: a tensor already laid out as ``empty_like(ref)`` is returned as it
    is; any other layout is copied once into that one."""
    ref = torch.randn(B, S, H, D).transpose(1, 2)             # (B, H, S, D) views of BSHD
    same = torch.randn(B, S, H, D).transpose(1, 2)
    assert _build.like(same, ref) is same
    other = torch.randn(B, H, S, D)
    got = _build.like(other, ref)
    assert got.stride() == ref.stride() and torch.equal(got, other)
    gapped = torch.randn(B, H, S, 2 * D)[..., :D]             # not dense: empty_like is contiguous
    assert _build.like(other, gapped) is other


def test_attention_on_cuda_keeps_its_inputs_layouts():
    """The attention's fake kernel on (fake) CUDA tensors in Hugging Face's layout: the
    output and the gradients come back in the queries', keys' and values' strides, so the
    transpose back to (B, S, H * D) needs no copy; on the CPU they stay contiguous."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(B, S, H, D, device="cuda").transpose(1, 2)
        k, v = (torch.empty(B, S, HKV, D, device="cuda").transpose(1, 2) for _ in "kv")
        out, lse = torch.ops.meshlab.attention(q, k, v, True, 0.25)
        grads = torch.ops.meshlab.attention_backward(out, q, k, v, out, lse, True, 0.25)
        assert out.stride() == q.stride() and lse.is_contiguous()
        assert [g.stride() for g in grads] == [q.stride(), k.stride(), v.stride()]
        assert out.transpose(1, 2).reshape(B, S, H * D)._base is not None     # a view
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(B, S, H, D).transpose(1, 2)
        out, _ = torch.ops.meshlab.attention(q, q, q, True, 0.25)
        assert out.is_contiguous()
