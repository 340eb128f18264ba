"""Merged projections for decoding (``InferenceConfig(use_cuda_kernel=True)``): one
matrix product where an attention layer makes three and a gated MLP two.

A decode step at small batches is many small kernels, each reading its weight once; the
query, key and value projections read the same input, and so do the gate and up
projections. Here each such group's weights are copied once into one tensor and the
modules' own parameters become views of it (no second copy of the weights; the state
dict keeps its names and shapes):

* attention (``q_proj``, ``k_proj``, ``v_proj``: bare ``nn.Linear`` as the fused MLP takes
  them, biases allowed, of one input size): ``q_proj``'s instance ``forward`` runs the
  merged product and hands the key and value parts to ``k_proj`` and ``v_proj``, whose
  instance forwards return them when called on the same input tensor. Called on another
  input (a family that feeds them differently), a projection computes its own product and
  the miss is counted (``Merged.misses``), so the result is always the module's own.
* gated MLP (``gate_proj``, ``up_proj`` bare, no bias, SiLU or tanh GELU): one product
  for both and ``meshlab::swiglu`` (``meshlab::geglu``) on its two halves.
* every other bare ``nn.Linear`` (output and down projections, the head) and the merged
  query/key/value product: :func:`decode_linear`, which sends a single row on CUDA to a
  Triton matrix-vector kernel (``meshlab/ops/_triton_gemv.py``: 1.1-1.7x cuBLAS on the
  products of a batch-1 decode step) and everything else to ``F.linear``.

The parts of a product of several rows are strided views (each row holds all parts); the
Triton rotary and swiglu kernels read them in place, the queries and keys leave the
rotary contiguous and the values go to the cache as they are.

What the model routes is in ``model._meshlab_merged`` (:class:`Merged`).
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import _build
from ..parallel.fuse._hf import _bare_linear, _gate_kind


_PLAIN = (Tensor, nn.Parameter)


def one_row(x: Tensor, w: Tensor, b: Tensor | None) -> bool:
    """Whether ``F.linear(x, w, b)`` suits the matrix-vector kernel, the device aside: one
    row, plain tensors (parameters included; no DTensor or other subclass) of one dtype,
    unit column strides."""
    return (x.numel() == w.shape[1] and x.stride(-1) == 1 and w.stride(1) == 1
            and type(x) in _PLAIN and type(w) in _PLAIN and x.dtype == w.dtype
            and (b is None or (type(b) in _PLAIN and b.dtype == w.dtype and b.stride(0) == 1)))


def decode_linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, b)``. On CUDA, what :func:`one_row` accepts at a shape the kernel
    wins at (``_triton_gemv.wins``) runs the Triton matrix-vector kernel; anything else
    (several rows, CPU, DTensors, tracing by ``torch.compile``, kernels switched off) runs
    ``F.linear``."""
    if one_row(x, w, b) and x.is_cuda and not torch.compiler.is_compiling():
        mod = _build.triton_kernels("decode_linear")
        if mod is not None and mod.wins(*w.shape):
            return mod.gemv(x, w, b).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, b)


@dataclasses.dataclass
class Merged:
    """The merged projections of a model: modules by kind, and the calls that could not
    take the merged product."""

    qkv: list[str] = dataclasses.field(default_factory=list)
    gate_up: list[str] = dataclasses.field(default_factory=list)
    linear: list[str] = dataclasses.field(default_factory=list)   # through decode_linear
    misses: int = 0

    def counts(self) -> dict[str, int]:
        return {"qkv": len(self.qkv), "gate_up": len(self.gate_up),
                "linear": len(self.linear)}


def _fuse_weights(mods) -> tuple[Tensor, Tensor | None]:
    """One tensor holding the modules' weights (and biases) in order; each module's
    parameters become views of it."""
    with torch.no_grad():
        w = torch.cat([m.weight for m in mods])
        b = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
        at = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = w[at:at + n]
            if b is not None:
                m.bias.data = b[at:at + n]
            at += n
    return w, b


class _Group:
    """The merged product of one attention layer, handed from ``q_proj`` to the others."""

    def __init__(self, mods, report: Merged):
        self.w, self.b = _fuse_weights(mods)
        self.sizes = [m.weight.shape[0] for m in mods]
        self.report = report
        self.held: dict[int, tuple[Tensor, Tensor]] = {}   # part -> (input, output)

    def first(self, q: nn.Linear, x: Tensor) -> Tensor:
        parts = decode_linear(x, self.w, self.b).split(self.sizes, -1)
        self.held = {i: (x, p) for i, p in enumerate(parts) if i}
        return parts[0]

    def take(self, i: int, m: nn.Linear, x: Tensor) -> Tensor:
        got = self.held.pop(i, None)
        if got is not None and got[0] is x:
            return got[1]
        self.report.misses += 1                     # merged for another input, or not at all
        return F.linear(x, m.weight, m.bias)


def _merge_qkv(m: nn.Module, report: Merged) -> bool:
    projs = [getattr(m, a, None) for a in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(p, nn.Linear) for p in projs):
        return False
    q = projs[0]
    if not all(_bare_linear(p, q.weight.dtype, bias=True) and p.in_features == q.in_features
               and (p.bias is None) == (q.bias is None) for p in projs):
        return False
    g = _Group(projs, report)
    projs[0].forward = types.MethodType(lambda self, x: g.first(self, x), projs[0])
    for i, p in enumerate(projs[1:], 1):
        p.forward = types.MethodType(lambda self, x, i=i: g.take(i, self, x), p)
    return True


def _merged_mlp_forward(self, x: Tensor) -> Tensor:
    from ..ops.swiglu import geglu, swiglu

    a, b = F.linear(x, self._meshlab_gate_up).chunk(2, -1)
    return self.down_proj((swiglu if _gate_kind(self) == "swiglu" else geglu)(a, b))


def _merge_gate_up(m: nn.Module) -> bool:
    if _gate_kind(m) is None or not hasattr(m, "gate_proj"):   # gate_up_proj: merged already
        return False
    g, u = m.gate_proj, m.up_proj
    if not (_bare_linear(g, g.weight.dtype) and _bare_linear(u, g.weight.dtype)
            and g.weight.shape == u.weight.shape):
        return False
    m._meshlab_gate_up, _ = _fuse_weights([g, u])
    m.forward = types.MethodType(_merged_mlp_forward, m)
    return True


def _linear_forward(self, x: Tensor) -> Tensor:
    return decode_linear(x, self.weight, self.bias)


def merge_projections(model: nn.Module) -> Merged:
    """Merge every attention layer's query/key/value projections and every gated MLP's
    gate/up projections that qualify, and route the other bare linear layers through
    :func:`decode_linear` (module docstring); returns what was routed."""
    report = Merged()
    for name, m in model.named_modules():
        if _merge_qkv(m, report):
            report.qkv.append(name)
        elif _merge_gate_up(m):
            report.gate_up.append(name)
    merged = {f"{a}.{p}".lstrip(".") for a in report.qkv for p in ("q_proj", "k_proj", "v_proj")}
    merged |= {f"{a}.{p}".lstrip(".") for a in report.gate_up for p in ("gate_proj", "up_proj")}
    for name, m in model.named_modules():
        if name not in merged and isinstance(m, nn.Linear) and "forward" not in vars(m) \
                and _bare_linear(m, m.weight.dtype, bias=True):
            m.forward = types.MethodType(_linear_forward, m)
            report.linear.append(name)
    model._meshlab_merged = report
    return report
