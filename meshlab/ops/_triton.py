"""Triton kernels of meshlab's fused ops, for CUDA tensors.

Imported only when an op first sees a CUDA tensor (``_build.triton_kernels``), so a machine
without Triton never loads this file. The functions mirror ``csrc/ops_cpu.cpp`` one for one
(same names, same arguments: activations 2-D and contiguous, weights and statistics
float32; outputs allocated contiguous, never with an input's strides, as the ops' fake
kernels say), so each op calls whichever module the device selects in the same way. The
rotary and swiglu forwards take any layout in both (C++ makes its inputs contiguous);
here ``rotary_fwd`` reads tokens at any one stride (and its angle tables in their own
dtype and row stride) and ``swiglu_fwd`` rows at any stride, so the parts of a merged
projection and slices of the model's tables go in without a copy.

Why Triton and not hand CUDA: these ops are memory-bound (a few flops per byte moved), so
their speed is one read of each input and one write of each output, in wide coalesced
loads; a Triton program over a row or a block gets that, fusion included, in a few lines,
with no nvcc at install time. Reductions (a row's sum of squares) stay in registers;
weight gradients are summed per program over a band of rows, then once over programs.

The forward kernels (the ones a decode step runs) launch with programmatic dependent
launch on Hopper and later (:func:`pdl`): each starts by letting the next kernel launch and
then waits for the one before it to finish, so the next kernel's programs are placed on
the device while this one drains instead of after it. Nothing is read before the wait
except what no kernel writes (the matrix-vector kernel's weights), so results are those
of kernels run one after another.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:        # grid dependency control: Triton 3.3 and later, for sm_90 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:     # pragma: no cover - older Triton: pdl() is False, the calls unused
    gdc_launch_dependents = gdc_wait = None


_PDL: dict[int, bool] = {}


def pdl(device) -> bool:
    """Whether kernels on CUDA ``device`` launch with programmatic dependent launch: on
    compute capability 9.0 and later, with a Triton that has grid dependency control, not
    under Triton's interpreter, and unless ``MESHLAB_PDL=0`` (read once per device)."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL:
        _PDL[idx] = (gdc_wait is not None and os.environ.get("MESHLAB_PDL", "1") != "0"
                     and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
                     and torch.cuda.get_device_capability(idx)[0] >= 9)
    return _PDL[idx]


def chained(device) -> dict:
    """Launch arguments of a forward kernel that starts with :func:`_after_previous`: its
    ``PDL`` switch and Triton's ``launch_pdl``, both :func:`pdl` of ``device``."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def _after_previous(PDL: tl.constexpr):
    # With PDL: the next kernel may be placed now; wait until the previous one has finished
    # and its writes are visible (module docstring). A no-op without.
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def _row_block(h: int) -> tuple[int, int]:
    block = triton.next_power_of_2(h)
    # Enough warps that each thread holds a few 16-byte vectors of the row, not dozens.
    return block, min(16, max(4, block // 512))


_SMS: dict[int, int] = {}


def sm_count(device) -> int:
    """The device's multiprocessors (read once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


_COUNTERS: dict[tuple, torch.Tensor] = {}
_REPLACED: list = []        # smaller counter sets, kept alive for graphs that captured them


def counters(n: int, device, name: str) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device`` for the kernels called ``name``, all 0
    between launches: a kernel's programs count themselves in, and the last one does the
    finishing work and sets its counter back to 0. Made outside graph capture (a warm-up
    call makes them); a larger set replaces a smaller one, which stays alive for any graph
    that captured it. The launches that use one set must run on one stream at a time, as
    a decode step's do."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    have = _COUNTERS.get((dev, name))
    if have is None or have.numel() < n:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"meshlab's {name} kernel: its first call needing {n} "
                               f"counters is being captured in a CUDA graph; run the step "
                               f"once before capturing it (a warm-up), so they exist")
        _REPLACED.append(have)
        _COUNTERS[(dev, name)] = have = torch.zeros(max(n, 4096), dtype=torch.int32,
                                                    device=dev)
    return have


def _bands(n: int, device) -> tuple[int, int]:
    # Backward kernels: a few programs per multiprocessor, each over a band of rows, so the
    # weight-gradient partials are (programs, H), small next to (n, H).
    programs = max(1, min(n, 4 * sm_count(device)))
    return programs, triton.cdiv(n, programs)


# ------------------------------------------------------------------ rms_norm

@triton.jit
def _rms_fwd(X, W, Y, RSTD, H, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * H + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _add_rms_fwd(X, R, W, Y, S, RSTD, H, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # s = x + r rounded to the activations' dtype, as a separate add rounds it; y = norm(s).
    _after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(S.dtype.element_ty)
    tl.store(S + row * H + cols, s, mask=mask)
    s = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * H + cols, (s * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd(DY, X, W, RSTD, DX, DWP, DS, N, H, rows_per, BLOCK: tl.constexpr,
             HAS_DS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, rows_per):
        # The last band may run past N: its extra rows load zeros and store nothing.
        r = pid.to(tl.int64) * rows_per + i
        ok = r < N
        m = mask & ok
        x = tl.load(X + r * H + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + r * H + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=ok, other=0.0)
        xh = x * rstd
        g = dy * w
        c = tl.sum(g * xh, axis=0) / H
        dx = (g - xh * c) * rstd
        if HAS_DS:      # the gradient reaching x around the norm (a residual), added once
            dx += tl.load(DS + r * H + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(DX + r * H + cols, dx.to(DX.dtype.element_ty), mask=m)
        acc += dy * xh
    tl.store(DWP + pid.to(tl.int64) * H + cols, acc, mask=mask)


def rms_norm_fwd(x, w, eps):
    n, h = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    block, warps = _row_block(h)
    _rms_fwd[(n,)](x, w, y, rstd, h, eps, BLOCK=block, num_warps=warps, **chained(x.device))
    return y, rstd


def add_rms_norm_fwd(x, r, w, eps):
    n, h = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    s = torch.empty_like(y)
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    block, warps = _row_block(h)
    _add_rms_fwd[(n,)](x, r, w, y, s, rstd, h, eps, BLOCK=block, num_warps=warps,
                       **chained(x.device))
    return y, s, rstd


def rms_norm_bwd(dy, x, w, rstd, ds=None):
    """``ds``: a gradient reaching ``x`` besides through the norm, added into ``dx``."""
    n, h = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    programs, rows_per = _bands(n, x.device)
    part = torch.empty(programs, h, device=x.device, dtype=torch.float32)
    block, warps = _row_block(h)
    _rms_bwd[(programs,)](dy, x, w, rstd, dx, part, dx if ds is None else ds, n, h, rows_per,
                          BLOCK=block, HAS_DS=ds is not None, num_warps=warps)
    return dx, part.sum(0)


# ------------------------------------------------------------------ layer_norm

@triton.jit
def _ln_fwd(X, W, B, Y, MEAN, RSTD, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / H
    d = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / H + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * H + cols, (d * rstd * w + b).to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _ln_bwd(DY, X, W, MEAN, RSTD, DX, DWP, DBP, N, H, rows_per, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    aw = tl.zeros([BLOCK], dtype=tl.float32)
    ab = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, rows_per):
        r = pid.to(tl.int64) * rows_per + i
        ok = r < N
        m = mask & ok
        x = tl.load(X + r * H + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + r * H + cols, mask=m, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + r, mask=ok, other=0.0)
        rstd = tl.load(RSTD + r, mask=ok, other=0.0)
        xh = tl.where(m, (x - mean) * rstd, 0.0)
        g = dy * w
        mg = tl.sum(g, axis=0) / H
        mgx = tl.sum(g * xh, axis=0) / H
        tl.store(DX + r * H + cols, ((g - mg - xh * mgx) * rstd).to(DX.dtype.element_ty), mask=m)
        aw += dy * xh
        ab += dy
    tl.store(DWP + pid.to(tl.int64) * H + cols, aw, mask=mask)
    tl.store(DBP + pid.to(tl.int64) * H + cols, ab, mask=mask)


def layer_norm_fwd(x, w, b, eps):
    n, h = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = torch.empty(n, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block, warps = _row_block(h)
    _ln_fwd[(n,)](x, w, b, y, mean, rstd, h, eps, BLOCK=block, num_warps=warps)
    return y, mean, rstd


def layer_norm_bwd(dy, x, w, mean, rstd):
    n, h = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    programs, rows_per = _bands(n, x.device)
    pw = torch.empty(programs, h, device=x.device, dtype=torch.float32)
    pb = torch.empty_like(pw)
    block, warps = _row_block(h)
    _ln_bwd[(programs,)](dy, x, w, mean, rstd, dx, pw, pb, n, h, rows_per, BLOCK=block,
                         num_warps=warps)
    return dx, pw.sum(0), pb.sum(0)


# ------------------------------------------------------------------ rotary

@triton.jit
def _rotary(X, COS, SIN, O, S, NH, HALF, XT, CS, SS, BLOCK_H: tl.constexpr,
            BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    # One program per token and BLOCK_H of its heads, which share one row of cos/sin. XT:
    # the token stride of x (its heads and dims are contiguous; its tokens need not be, as
    # in a part of a merged query/key/value product); the output is contiguous. CS, SS: the
    # row strides of cos and sin, read in their own dtype (a slice of the model's (S, D)
    # tables, so no cast or copy of them runs per call).
    _after_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    s = tok % S
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NH) & (d < HALF)
    inner = h * 2 * HALF + d
    base = tok * NH * 2 * HALF + inner
    c = tl.load(COS + s * CS + d, mask=d < HALF, other=0.0).to(tl.float32)
    sn = tl.load(SIN + s * SS + d, mask=d < HALF, other=0.0).to(tl.float32)
    x1 = tl.load(X + tok * XT + inner, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + tok * XT + inner + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + base, (x1 * c - x2 * sn).to(O.dtype.element_ty), mask=mask)
    tl.store(O + base + HALF, (x2 * c + x1 * sn).to(O.dtype.element_ty), mask=mask)


def _token_stride(x) -> int | None:
    """The one stride between x's consecutive tokens (B, S flattened), its heads and dims
    contiguous; None where there is no such stride."""
    b, s, nh, d = x.shape
    if x.stride(-1) != 1 or (nh > 1 and x.stride(-2) != d):
        return None
    if s == 1:
        return x.stride(0)
    return x.stride(1) if b == 1 or x.stride(0) == s * x.stride(1) else None


# Heads per program where there are fewer tokens than multiprocessors: a decode step's one
# token would otherwise be one program walking all of its heads.
_FEW_TOKENS_HEADS = 4


def rotary_fwd(x, cos, sin):
    b, s, nh, d = x.shape
    xt = _token_stride(x)
    if xt is None:
        x = x.contiguous()
        xt = nh * d
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = d // 2
    bh, bd = triton.next_power_of_2(nh), triton.next_power_of_2(half)
    if b * s < (sm_count(x.device) if x.is_cuda else 1):   # few tokens: heads over programs
        bh = min(bh, _FEW_TOKENS_HEADS)
    _rotary[(b * s, triton.cdiv(nh, bh))](x, cos, sin, out, s, nh, half, xt, cos.stride(0),
                                          sin.stride(0), BLOCK_H=bh, BLOCK_D=bd,
                                          num_warps=4 if bh * bd <= 2048 else 8,
                                          **chained(x.device))
    return out


# ------------------------------------------------------------------ swiglu

_EW_BLOCK = 2048


@triton.jit
def _gelu_tanh(a):
    # tanh(sqrt(2 / pi) * (a + 0.044715 a^3)), as 2 sigmoid(2u) - 1 (Triton has no tanh)
    return 2.0 * tl.sigmoid(2.0 * 0.7978845608028654 * (a + 0.044715 * a * a * a)) - 1.0


@triton.jit
def _gate(a, ACT: tl.constexpr):
    # ACT 0: silu(a); 1: GELU with the tanh approximation.
    if ACT == 0:
        return a * tl.sigmoid(a)
    else:
        return 0.5 * a * (1.0 + _gelu_tanh(a))


@triton.jit
def _gate_grad(a, ACT: tl.constexpr):
    if ACT == 0:
        sg = tl.sigmoid(a)
        return sg * (1.0 + a * (1.0 - sg))
    else:
        t = _gelu_tanh(a)
        return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * \
            (1.0 + 3.0 * 0.044715 * a * a)


@triton.jit
def _swiglu_fwd(A, B, Y, n, COLS, SA, SB, BLOCK: tl.constexpr, STRIDED: tl.constexpr,
                ACT: tl.constexpr, PDL: tl.constexpr):
    # STRIDED: a and b are rows of COLS with row strides SA and SB (the halves of a merged
    # gate/up product); else both are contiguous. y is contiguous.
    _after_previous(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if STRIDED:
        row = offs // COLS
        col = offs - row * COLS
        pa = A + row * SA + col
        pb = B + row * SB + col
    else:
        pa = A + offs
        pb = B + offs
    a = tl.load(pa, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(pb, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (_gate(a, ACT) * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, A, B, DA, DB, Y, n, COLS, SD, BLOCK: tl.constexpr, WRITE_Y: tl.constexpr,
                ACT: tl.constexpr, SIDE_BY_SIDE: tl.constexpr):
    # WRITE_Y: also rebuild y = silu(a) * b from the a and b read anyway, for a caller that
    # did not keep y (the fused MLP's down projection needs it for its weight's gradient).
    # SIDE_BY_SIDE: da and db are the halves of rows of SD = 2 * COLS (one buffer, whose
    # transpose times x is both weights' gradients in one product); else contiguous.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    act = _gate(a, ACT)
    if SIDE_BY_SIDE:
        row = offs // COLS
        out = row * SD + (offs - row * COLS)
    else:
        out = offs
    tl.store(DA + out, (g * b * _gate_grad(a, ACT)).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + out, (g * act).to(DB.dtype.element_ty), mask=mask)
    if WRITE_Y:
        tl.store(Y + offs, (act * b).to(Y.dtype.element_ty), mask=mask)


def _rows(t):
    """t as (rows, last dim) without a copy where its last dim is contiguous, else a
    contiguous copy so viewed."""
    cols = t.shape[-1]
    if t.stride(-1) == 1:
        try:
            return t.view(-1, cols)
        except RuntimeError:
            pass
    return t.contiguous().view(-1, cols)


def swiglu_fwd(a, b, act=0):
    """act(a) * b; ``act`` 0 SiLU (SwiGLU), 1 tanh-approximated GELU (GeGLU)."""
    y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    n, cols = a.numel(), a.shape[-1]
    a2, b2 = _rows(a), _rows(b)
    strided = a2.stride(0) != cols or b2.stride(0) != cols
    _swiglu_fwd[(triton.cdiv(n, _EW_BLOCK),)](a2, b2, y, n, cols, a2.stride(0), b2.stride(0),
                                              BLOCK=_EW_BLOCK, STRIDED=strided, ACT=act,
                                              num_warps=8, **chained(a.device))
    return y


def _swiglu_backward(dy, a, b, write_y: bool, act: int, side_by_side: bool = False):
    n, cols = a.numel(), a.shape[-1]
    if side_by_side:
        both = torch.empty(n // cols, 2 * cols, dtype=a.dtype, device=a.device)
        da, db = both[:, :cols], both[:, cols:]
    else:
        da = torch.empty_like(a, memory_format=torch.contiguous_format)
        db = torch.empty_like(b, memory_format=torch.contiguous_format)
    y = torch.empty_like(a, memory_format=torch.contiguous_format) if write_y else da
    _swiglu_bwd[(triton.cdiv(n, _EW_BLOCK),)](dy, a, b, da, db, y, n, cols, 2 * cols,
                                              BLOCK=_EW_BLOCK, WRITE_Y=write_y, ACT=act,
                                              SIDE_BY_SIDE=side_by_side, num_warps=8)
    if side_by_side:
        return both, y
    return (da, db, y) if write_y else (da, db)


def swiglu_bwd(dy, a, b, act=0):
    return _swiglu_backward(dy, a, b, False, act)


def swiglu_bwd_y(dy, a, b, act=0):
    return _swiglu_backward(dy, a, b, True, act)


def swiglu_bwd_y_side_by_side(dy, a, b, act=0):
    """(dab, y): the gradients of a and b as the two halves of each row of one
    (rows, 2 * cols) buffer, and y rebuilt. a, b, dy contiguous, of one shape."""
    return _swiglu_backward(dy, a, b, True, act, side_by_side=True)


# ------------------------------------------------------------------ cross-entropy gradient

_CE_BLOCK = 4096


@triton.jit
def _ce_grad(Z, T, LOSS, V, ignore_index, BLOCK: tl.constexpr):
    # One program per row of logits: an online max and sum of exponentials in one pass,
    # then the row is overwritten by softmax - onehot(target), times 0 on an ignored row.
    # The row is read twice and written once; nothing of size V is kept beside it.
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row)
    keep = tl.where(t == ignore_index, 0.0, 1.0)
    base = Z + row * V
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.range(0, V, BLOCK):
        z = tl.load(base + s + cols, mask=s + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        # Lanes that have seen only -inf keep 0 (exp(-inf - -inf) would be NaN).
        acc = tl.where(m_new == float("-inf"), 0.0, acc * tl.exp(m - m_new) + tl.exp(z - m_new))
        m = m_new
    mx = tl.max(m, axis=0)
    lse = mx + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, acc * tl.exp(m - mx)), axis=0))
    # An out-of-range target gives a NaN loss rather than a read past the row (a check on
    # the host would cost a device synchronization per call).
    ok = (t >= 0) & (t < V)
    zt = tl.load(base + tl.where(ok, t, 0)).to(tl.float32)
    zt = tl.where(ok, zt, float("nan"))
    tl.store(LOSS + row, tl.where(t == ignore_index, 0.0, lse - zt))
    for s in tl.range(0, V, BLOCK):
        c = s + cols
        z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        g = (tl.exp(z - lse) - tl.where(c == t, 1.0, 0.0)) * keep
        tl.store(base + c, g.to(Z.dtype.element_ty), mask=c < V)


def ce_grad_inplace(logits, target, ignore_index):
    n, v = logits.shape
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    if n:
        _ce_grad[(n,)](logits, target, loss, v, ignore_index, BLOCK=min(_CE_BLOCK,
                       triton.next_power_of_2(v)), num_warps=8)
    return loss
