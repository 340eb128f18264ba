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
  products: :func:`decode_linear`, which sends a single row on CUDA to a Triton
  matrix-vector kernel (``meshlab/ops/_triton_gemv.py``: 1.01-1.75x cuBLAS on the products
  of a batch-1 decode step on an H200, the gate/up one only where kernels launch with
  programmatic dependent launch) and everything else to ``F.linear``.
* a decoder layer fuse routed (norm, attention, ``add_rms_norm``, MLP, add), with both
  groups merged: :func:`_decode_layer_forward` hands the attention the layer's input, the
  merged product normalizes it (inside the kernel for a single row, where that measured
  faster), and the down product adds the residual: one or two kernels fewer a layer at
  batch 1. Each layer class is probed
  first (a small copy, its own forward against this one); ``Merged.unfused`` says why a
  class was left alone.

The parts of a product of several rows are strided views (each row holds all parts); the
Triton rotary and swiglu kernels read them in place, the queries and keys leave the
rotary contiguous and the values go to the cache as they are.

And :func:`table_rotary` gives rotary-embedding modules a table of their angles (the
engine calls it with the positions a request can reach).

What the model routes is in ``merged_of(model)`` (:class:`Merged`).
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import _build
from ..transforms.fuse.shared import (Handoff, bare_linear, gate_kind, layer_routed, norm_eps,
                                      norm_rule, probe_layer, set_norm_rule)
from ._paged import current_batch


_PLAIN = (Tensor, nn.Parameter)


def one_row(x: Tensor, w: Tensor, b: Tensor | None) -> bool:
    """Whether ``F.linear(x, w, b)`` suits the matrix-vector kernel, the device aside: one
    row, plain tensors (parameters included; no DTensor or other subclass) of one dtype,
    unit column strides."""
    return (x.numel() == w.shape[1] and x.stride(-1) == 1 and w.stride(1) == 1
            and type(x) in _PLAIN and type(w) in _PLAIN and x.dtype == w.dtype
            and (b is None or (type(b) in _PLAIN and b.dtype == w.dtype and b.stride(0) == 1)))


def _vector(t: Tensor, n: int, dtype: torch.dtype | None) -> bool:
    return type(t) in _PLAIN and t.numel() == n and t.is_contiguous() and \
        (dtype is None or t.dtype == dtype)


def _row_kernel(x: Tensor, w: Tensor, b: Tensor | None):
    """The matrix-vector kernel module where ``F.linear(x, w, b)`` should run it: what
    :func:`one_row` accepts, on CUDA, outside tracing, with the kernels on, at a shape it
    wins at (``_triton_gemv.wins``); else ``None``."""
    if not (one_row(x, w, b) and x.is_cuda and not torch.compiler.is_compiling()):
        return None
    mod = _build.triton_kernels("decode_linear")
    return mod if mod is not None and mod.wins(*w.shape, x.device) else None


def decode_linear(x: Tensor, w: Tensor, b: Tensor | None = None, *,
                  norm: nn.Module | None = None, residual: Tensor | None = None) -> Tensor:
    """``F.linear(norm(x), w, b) + residual`` (``norm`` a routed RMS norm module, each part
    optional). Where :func:`_row_kernel` says so, the Triton matrix-vector kernel runs it,
    the residual add inside it, and the norm too where that measured faster
    (``takes_norm``; else the norm's own kernel first), in float32; anything else
    (several rows, CPU, DTensors, tracing by ``torch.compile``, kernels switched off)
    runs the norm, ``F.linear`` and the add."""
    n, k = w.shape
    mod = _row_kernel(x, w, b)
    if mod is not None and (residual is None or _vector(residual, n, w.dtype)) \
            and (norm is None or _vector(norm.weight, k, None)):
        if norm is not None and not mod.takes_norm(n, k):
            x, norm = norm(x), None
        y = mod.gemv(x, w, b, None if residual is None else residual.view(n),
                     None if norm is None else norm.weight,
                     0.0 if norm is None else norm_eps(norm))
        return y.view(*x.shape[:-1], n)
    y = F.linear(x if norm is None else norm(x), w, b)
    return y if residual is None else residual + y


@dataclasses.dataclass
class Merged:
    """The merged projections of a model: modules by kind, and the calls that could not
    take the merged product."""

    qkv: list[str] = dataclasses.field(default_factory=list)
    gate_up: list[str] = dataclasses.field(default_factory=list)
    linear: list[str] = dataclasses.field(default_factory=list)   # through decode_linear
    layers: list[str] = dataclasses.field(default_factory=list)   # norm and add in products
    unfused: dict[str, str] = dataclasses.field(default_factory=dict)   # layer class -> why
    tables: list[str] = dataclasses.field(default_factory=list)   # rotary angles looked up
    misses: int = 0

    def counts(self) -> dict[str, int]:
        return {"qkv": len(self.qkv), "gate_up": len(self.gate_up),
                "linear": len(self.linear), "layers": len(self.layers),
                "rotary_tables": len(self.tables)}


def _fuse_weights(mods) -> tuple[Tensor, Tensor | None]:
    """One tensor holding the modules' weights (and biases) in order; each module's
    parameters become views of it."""
    with torch.no_grad():
        w = torch.cat([m.weight for m in mods])
        b = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
        at = 0
        for m in mods:
            m._meshlab_merged_part = True
            n = m.weight.shape[0]
            m.weight.data = w[at:at + n]
            if b is not None:
                m.bias.data = b[at:at + n]
            at += n
    return w, b


class _Group(Handoff):
    """The merged product of one attention layer, handed from ``q_proj`` to the others."""

    def __init__(self, mods, report: Merged):
        super().__init__(mods)
        self.w, self.b = _fuse_weights(mods)
        self.sizes = [m.weight.shape[0] for m in mods]
        self.report = report
        self.norm: nn.Module | None = None     # set by _decode_layer_forward for one call

    def products(self, x):
        return decode_linear(x, self.w, self.b, norm=self.norm).split(self.sizes, -1)

    def missed(self, other_input):
        self.report.misses += 1                     # merged for another input, or not at all


def _merge_qkv(m: nn.Module, report: Merged) -> bool:
    projs = [getattr(m, a, None) for a in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(p, nn.Linear) for p in projs):
        return False
    q = projs[0]
    if not all(bare_linear(p, q.weight.dtype, bias=True) and p.in_features == q.in_features
               and (p.bias is None) == (q.bias is None) for p in projs):
        return False
    q._meshlab_group = _Group(projs, report)
    q._meshlab_group.install()
    return True


def _merged_mlp_forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
    from ..ops.swiglu import geglu, swiglu

    a, b = decode_linear(x, self._meshlab_gate_up).chunk(2, -1)
    act = (swiglu if gate_kind(self) == "swiglu" else geglu)(a, b)
    if residual is None:
        return self.down_proj(act)
    d = self.down_proj
    return decode_linear(act, d.weight, d.bias, residual=residual)


def _merge_gate_up(m: nn.Module) -> bool:
    if gate_kind(m) is None or not hasattr(m, "gate_proj"):   # gate_up_proj: merged already
        return False
    g, u = m.gate_proj, m.up_proj
    if not (bare_linear(g, g.weight.dtype) and bare_linear(u, g.weight.dtype)
            and g.weight.shape == u.weight.shape):
        return False
    m._meshlab_gate_up, _ = _fuse_weights([g, u])
    m.forward = types.MethodType(_merged_mlp_forward, m)
    return True


def _linear_forward(self, x: Tensor) -> Tensor:
    return decode_linear(x, self.weight, self.bias)


def _decode_layer_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """A routed pre-norm decoder layer (fuse's ``_fused_layer_forward``) whose first norm
    runs inside the merged query/key/value product and whose last residual add runs inside
    the down product (:func:`decode_linear`): the attention is handed the layer's input,
    and its ``q_proj`` normalizes it. The middle add and norm stay ``add_rms_norm``."""
    from ..ops.rms_norm import add_rms_norm

    if args:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    group = self.self_attn.q_proj._meshlab_group
    group.norm = self.input_layernorm
    try:
        h, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    finally:
        group.norm = None
    post = self.post_attention_layernorm
    normed, hidden = add_rms_norm(h, hidden_states, post.weight, norm_eps(post))
    return _merged_mlp_forward(self.mlp, normed, residual=hidden)


def _decode_layer_ready(m: nn.Module) -> bool:
    """A layer fuse routed (its middle add in ``add_rms_norm``) whose query/key/value and
    gate/up products are merged here, with a bare down projection and a routed input norm
    of no weight offset."""
    if not layer_routed(m):
        return False
    rule = norm_rule(m.input_layernorm)
    q, mlp = getattr(m.self_attn, "q_proj", None), m.mlp
    return (rule is not None and not rule.offset and hasattr(q, "_meshlab_group")
            and hasattr(mlp, "_meshlab_gate_up")
            and bare_linear(mlp.down_proj, mlp.down_proj.weight.dtype, bias=True))


def _route_layers(model: nn.Module, report: Merged) -> None:
    probed: dict[str, str | None] = {}           # layer class -> why not, or None
    for name, m in model.named_modules():
        if not _decode_layer_ready(m):
            continue
        cls = type(m).__name__
        if cls not in probed:
            def prepare(clone, m=m):
                set_norm_rule(clone.input_layernorm, norm_rule(m.input_layernorm))
                _merge_qkv(clone.self_attn, Merged())
                _merge_gate_up(clone.mlp)

            with torch.random.fork_rng(devices=()):     # building the copy draws weights
                probed[cls] = probe_layer(m, _decode_layer_forward, prepare)
        if probed[cls] is None:
            m.forward = types.MethodType(_decode_layer_forward, m)
            report.layers.append(name)
    report.unfused.update({k: v for k, v in probed.items() if v is not None})


# Rotary embeddings whose angles depend on the position alone (transformers' rope types
# that ``dynamic_rope_update`` leaves as they are).
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _table_forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    table = self._meshlab_table
    if x.dtype != table.dtype or x.device != table.device or current_batch() is None:
        return type(self).forward(self, x, position_ids)
    both = table[position_ids]                          # (B, S, 2, D): one gather
    return both[..., 0, :], both[..., 1, :]


def table_rotary(model: nn.Module, length: int, dtype: torch.dtype) -> list[str]:
    """Give each rotary-embedding module of a static rope type a table of its own
    (cos, sin) for positions ``0 .. length - 1`` in ``dtype``, made by its forward once,
    and a forward that looks rows up in it: one gather a step where the module's own
    forward launches about eight small kernels (a product, cos, sin, scalings, casts).
    Each angle is one float32 product of a position and a frequency, so the rows equal
    what the forward computes for those positions alone. The table serves the engine's
    steps only (inside ``_paged.running``, whose positions the engine bounds); another
    call (``model.generate`` on the same model), dtype or device runs the module's own
    forward. Returns the modules' names."""
    done = []
    for name, m in model.named_modules():
        if getattr(m, "rope_type", None) not in _STATIC_ROPE or "forward" in vars(m) \
                or not isinstance(getattr(m, "inv_freq", None), Tensor):
            continue
        dev = m.inv_freq.device
        with torch.no_grad():
            cos, sin = m(torch.empty(0, device=dev, dtype=dtype),
                         torch.arange(length, device=dev)[None])
        m._meshlab_table = torch.stack([cos[0], sin[0]], 1)      # (length, 2, D)
        m.forward = types.MethodType(_table_forward, m)
        done.append(name)
    return done


def merge_projections(model: nn.Module) -> Merged:
    """Merge every attention layer's query/key/value projections and every gated MLP's
    gate/up projections that qualify, route the other bare linear layers through
    :func:`decode_linear`, and give each decoder layer that then qualifies (and whose
    class passes a probe) :func:`_decode_layer_forward` (module docstring); returns what
    was routed."""
    report = Merged()
    for name, m in model.named_modules():
        if _merge_qkv(m, report):
            report.qkv.append(name)
        elif _merge_gate_up(m):
            report.gate_up.append(name)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not getattr(m, "_meshlab_merged_part", False) \
                and "forward" not in vars(m) and bare_linear(m, m.weight.dtype, bias=True):
            m.forward = types.MethodType(_linear_forward, m)
            report.linear.append(name)
    _route_layers(model, report)
    model._meshlab_merged = report
    return report


def merged_of(model: nn.Module) -> Merged | None:
    """What :func:`merge_projections` routed in ``model``, or None where it did not run."""
    return getattr(model, "_meshlab_merged", None)
