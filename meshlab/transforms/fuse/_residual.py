"""A pre-norm decoder layer's sums inside the passes that already read their terms, and
the closeness test every routing probe of fuse applies (:func:`probe_difference`).

Part of fuse's ``rms_norm`` routing (``_hf``): a layer with Llama's parts
(``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``) whose norm
is routed gets an instance ``forward`` (where a probe of the layer's class, a small copy
run through its own forward and the fused one, agrees) that

* runs ``residual + attention`` and the norm after it as one ``meshlab::add_rms_norm``;
* adds the gradient of the layer's input that flows along the residual stream inside the
  first norm's backward kernel (:func:`meshlab.ops.rms_norm.rms_norm_fork`);

and where its attention's query, key and value projections are bare ``nn.Linear`` maps,
the query projection computes the three products as one :class:`_SharedInput`, whose
backward sums their input gradient inside the products, and hands the key and value
projections their outputs (:class:`Handoff`, which the inference engine's merged product
uses too). Autograd would otherwise add each of those terms in a pass of its own over a
(tokens, hidden) tensor. Other layers keep their own forward, and the report says why.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...core.errors import ConfigError
from ...ops.matmul import mm_sum
from .._install import forget_restore, restorable_forward


_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def in_float32(probe):
    """Run ``probe`` with float32 as the default dtype: a probe measures an op's math, and a
    model built under ``torch.set_default_dtype(torch.bfloat16)`` (a common way to build one
    in bf16) would otherwise make the probe's tensors in bf16 and see one rounding apart
    as a different formula. The fused op then runs in the model's dtype, as the module
    did, apart from it by that dtype's rounding."""
    @functools.wraps(probe)
    def run(*args, **kwargs):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            return probe(*args, **kwargs)
        finally:
            torch.set_default_dtype(old)

    return run


def probe_difference(got: Tensor, want: Tensor) -> float | None:
    """The relative difference of a probe's fused output from the module's own where it
    exceeds 1e-4 (float32 rounding), else None."""
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    return None if err < 1e-4 else err


def probe_close(got: Tensor, want: Tensor, what: str, fix: str) -> None:
    """Raise a ConfigError naming ``what`` and ``fix`` where :func:`probe_difference` finds
    the outputs apart."""
    err = probe_difference(got, want)
    if err is not None:
        raise ConfigError(f"{what}: meshlab's op does not reproduce this module's output "
                          f"(relative difference {err:.1e} on a probe); {fix}")


# What fuse routed rides on the modules themselves, under attributes set and read only in
# this file: a norm's rule (``Norm``, what ``meshlab::rms_norm`` reads of it) and the mark
# of a decoder layer given the fused residual add.
def norm_rule(m: nn.Module):
    """The rule (``Norm``) of a norm module fuse routed, or None."""
    return getattr(m, "_meshlab_norm", None)


def set_norm_rule(m: nn.Module, rule) -> None:
    """Route norm module ``m`` by ``rule`` (its forward reads it through ``norm_rule``)."""
    m._meshlab_norm = rule


def layer_routed(m: nn.Module) -> bool:
    """Whether decoder layer ``m`` runs the fused residual add (``route_layers``)."""
    return getattr(m, "_meshlab_layer", False)


def norm_eps(m: nn.Module) -> float:
    """The epsilon of a routed RMS norm module, read from the attribute its rule names."""
    return float(getattr(m, norm_rule(m).eps))


class _SharedInput(torch.autograd.Function):
    """Linear maps of one input (a layer's query, key and value projections), each its own
    product forward. The backward sums the input's gradient inside the products
    (``addmm_``) where autograd would add the maps' gradients in separate passes, and runs
    the maps after the first as one product each way (their gradients side by side): a
    layer's key and value parts are narrow, so a product of theirs is bound by reading and
    writing the (tokens, hidden) input gradient, which one product does once."""

    @staticmethod
    def forward(ctx, x, *wb):
        ws, bs = wb[0::2], wb[1::2]
        ctx.save_for_backward(x, *ws)
        ctx.biased = tuple(b is not None for b in bs)
        ctx.set_materialize_grads(False)    # an output not used passes None, not zeros
        return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        need = ctx.needs_input_grad
        grads: list = [None] * (2 * len(ws))
        rest = [i for i in range(1, len(ws)) if dys[i] is not None]
        parts = ([[0]] if dys[0] is not None else []) + ([rest] if rest else [])
        dx_parts: tuple[list, list] = ([], [])
        for part in parts:
            ds = [dys[i].reshape(-1, dys[i].shape[-1]) for i in part]
            d = ds[0] if len(ds) == 1 else torch.cat(ds, -1)
            if need[0]:
                w = ws[part[0]] if len(part) == 1 else torch.cat([ws[i] for i in part])
                dx_parts[0].append(d)
                dx_parts[1].append(w)
            widths = [t.shape[-1] for t in ds]
            if any(need[1 + 2 * i] for i in part):
                for i, g in zip(part, (d.t() @ flat).split(widths)):
                    grads[2 * i] = g if need[1 + 2 * i] else None
            if any(ctx.biased[i] and need[2 + 2 * i] for i in part):
                for i, g in zip(part, d.sum(0).split(widths)):
                    grads[2 * i + 1] = g if ctx.biased[i] and need[2 + 2 * i] else None
        dx = mm_sum(*dx_parts).view(x.shape) if dx_parts[0] else None
        return (dx, *grads)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _bare_linear(m: nn.Module, dtype: torch.dtype, bias: bool = False) -> bool:
    """An ``nn.Linear`` whose call is its weight's matmul and nothing else (plus its bias,
    where ``bias`` allows one): no hooks (tensor parallelism, LoRA and the like act through
    them or through a subclass), a plain weight of ``dtype``."""
    w = getattr(m, "weight", None)
    return type(m) is nn.Linear and (bias or m.bias is None) and not m._forward_hooks and \
        not m._forward_pre_hooks and not _is_dtensor(w) and w.dtype == dtype


class Handoff:
    """Linear maps of one input (an attention's query, key and value projections) whose
    products the first map's call computes together (:meth:`products`), handing each other
    map its output when that map is called with the same input; a map called with another
    input, or before the first, runs its own product. :meth:`install` gives the maps
    these calls as instance forwards."""

    def __init__(self, mods):
        self.mods = tuple(mods)
        self.held: dict[int, tuple[Tensor, Tensor]] = {}    # map -> (input, output)

    def install(self) -> None:
        """Give the maps these calls as instance forwards, each map marked with
        restorable (:meth:`uninstall`, ``transforms._install.restorable_forward``): a room that replaces a map with
        another module (``precision('fp8')``'s float8 layers) gives every map its own
        product back instead of losing the call."""
        for i, m in enumerate(self.mods):
            m.forward = _MapCall(self, i)
            restorable_forward(m, self.uninstall)

    def uninstall(self) -> None:
        """Every map runs its class's forward again (its own product: the same math)."""
        for m in self.mods:
            vars(m).pop("forward", None)
            forget_restore(m)
        self.held = {}

    def products(self, x: Tensor) -> tuple[Tensor, ...] | None:
        """Every map's output for ``x``, or None to run the first map's product alone."""
        raise NotImplementedError

    def missed(self, other_input: bool) -> None:
        """A map ran its own product: its held output was for ``other_input``, or none was
        held."""

    def first(self, m: nn.Linear, x: Tensor) -> Tensor:
        parts = self.products(x)
        if parts is None:        # held untouched
            return F.linear(x, m.weight, m.bias)
        self.held = {i: (x, p) for i, p in enumerate(parts) if i}
        return parts[0]

    def take(self, i: int, m: nn.Linear, x: Tensor) -> Tensor:
        got = self.held.pop(i) if i in self.held else None
        if got is not None and got[0] is x:
            return got[1]
        self.missed(got is not None)
        return F.linear(x, m.weight, m.bias)


class _MapCall:
    """Map ``i``'s call through its :class:`Handoff`: a value that holds both (no closure),
    so a ``copy.deepcopy`` of the model copies the Handoff with the copied maps, and the
    copy's maps hand each other the copy's products, not the original's."""

    def __init__(self, handoff: Handoff, i: int):
        self.handoff, self.i = handoff, i

    def __call__(self, x: Tensor) -> Tensor:
        h = self.handoff
        m = h.mods[self.i]
        return h.first(m, x) if self.i == 0 else h.take(self.i, m, x)


class _Shared(Handoff):
    """A training layer's query, key and value products as one :class:`_SharedInput`, on
    plain tensors of the maps' dtype, eagerly or traced into a compiled block (under
    autocast, with DTensors, in a checkpointed compiled block or once a map has hooks, each
    map runs its own product: the same math)."""

    def __init__(self, mods, where: str):
        super().__init__(mods)
        self.where, self.off = where, False

    def products(self, x):
        from ...ops import _build

        ms = self.mods
        dtype = ms[0].weight.dtype
        # compiled, the products are traced into the block's graph (a checkpointed block's
        # maps run their own: compile_blocks takes these forwards back there)
        plain = _build.plain(x, *(m.weight for m in ms)) if torch.compiler.is_compiling() \
            else _build.eager(x, *(m.weight for m in ms))
        if self.off or x.dtype != dtype or not plain or \
                torch.is_autocast_enabled(x.device.type) or \
                not all(_bare_linear(m, dtype, bias=True) for m in ms):
            return None
        return _SharedInput.apply(x, *(t for m in ms for t in (m.weight, m.bias)))

    def missed(self, other_input):
        if other_input and not self.off:
            self.off = True
            warnings.warn(f"fuse: {self.where} called its key or value projection on another "
                          f"input than its query projection; the products computed ahead "
                          f"went unused, and each projection runs its own from now on",
                          stacklevel=3)


_QKV = ("q_proj", "k_proj", "v_proj")


def _fused_layer_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """A pre-norm decoder layer (norm, attention, residual add, norm, MLP, residual add)
    whose residual stream's gradient joins the first norm's backward and whose middle add
    and the norm after it are one ``meshlab::add_rms_norm``. Positional extras, or a sum the op does not take
    (dtypes or shapes that differ, DTensors), run the class's own forward or the steps
    apart: the same math."""
    from torch.distributed.tensor import DTensor

    from ...ops.rms_norm import add_rms_norm, rms_norm_fork

    if args:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    first = self.input_layernorm
    rule = norm_rule(first)
    if rule is not None and not rule.offset:
        normed, residual = rms_norm_fork(hidden_states, first.weight, norm_eps(first))
    else:
        normed, residual = first(hidden_states), hidden_states
    h, _ = self.self_attn(hidden_states=normed, **kwargs)
    norm = self.post_attention_layernorm
    if h.dtype != residual.dtype or h.shape != residual.shape or \
            any(isinstance(t, DTensor) for t in (h, residual, norm.weight)):
        hidden = residual + h
        normed = norm(hidden)
    else:
        normed, hidden = add_rms_norm(h, residual, norm.weight, norm_eps(norm))
    if _bare_call(self.mlp):
        return self.mlp.forward(normed, residual=hidden)
    return hidden + self.mlp(normed)


def _bare_call(m: nn.Module) -> bool:
    """Whether calling ``m`` is calling its instance forward, one that takes a residual to
    add inside (fuse's gated MLP, marked ``takes_residual``), and nothing else: no hooks
    of its own or global ones, which could see or change an output that would then hold
    the residual."""
    from torch.nn.modules import module as _m

    own = vars(m).get("forward")
    return getattr(getattr(own, "__func__", None), "takes_residual", False) and \
        not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or
             m._backward_pre_hooks or _m._global_forward_hooks or
             _m._global_forward_pre_hooks or _m._global_backward_hooks or
             _m._global_backward_pre_hooks)


def _layer_fusable(m: nn.Module) -> bool:
    """A module with a pre-norm decoder layer's parts, its post-attention norm routed with
    no weight offset, and the class's own ``forward`` (no instance wrapper of another
    room, such as tensor parallelism's, to keep)."""
    if not all(isinstance(getattr(m, a, None), nn.Module) for a in _LAYER):
        return False
    rule = norm_rule(m.post_attention_layernorm)
    return rule is not None and not rule.offset and "forward" not in vars(m)


@in_float32
def _probe_layer(m: nn.Module, forward=_fused_layer_forward, prepare=None) -> str | None:
    """Why the layer's class cannot take ``forward`` (the fused residual add), or None: a
    small copy (hidden 16, 2 heads on 1 kv head of 8) runs its own forward and ``forward``
    on the same random input and weights (``prepare`` routes the copy first, where given),
    and the two must agree."""
    cfg = getattr(m, "config", None) or getattr(m.self_attn, "config", None)
    if cfg is None:
        return "no config to build a probe from"
    small = copy.deepcopy(cfg)
    for attr, v in (("hidden_size", 16), ("intermediate_size", 32), ("num_attention_heads", 2),
                    ("num_key_value_heads", 1), ("head_dim", 8)):
        if hasattr(small, attr):
            setattr(small, attr, v)
    small._attn_implementation = "eager"
    try:
        with torch.device("cpu"):
            clone = type(m)(small, 0).float()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in clone.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.ndim == 1 else 0))
        set_norm_rule(clone.post_attention_layernorm, norm_rule(m.post_attention_layernorm))
        first = norm_rule(m.input_layernorm)
        if first is not None:
            set_norm_rule(clone.input_layernorm, first)
        ang = torch.randn(2, 5, 4, generator=g)
        ang = torch.cat([ang, ang], -1)
        kw = dict(attention_mask=None, position_ids=torch.arange(5)[None].expand(2, 5),
                  position_embeddings=(ang.cos(), ang.sin()))
        x = torch.randn(2, 5, 16, generator=g)
        want = type(m).forward(clone, x, **kw)
        if prepare is not None:
            prepare(clone)
        got = forward(clone, x, **kw)
    except Exception as e:      # a class that differs: its layers keep their own forward
        return f"the probe failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    err = probe_difference(got, want)
    if err is not None:
        return (f"its forward is not norm, attention, add, norm, MLP, add (relative "
                f"difference {err:.1e} on a probe)")
    return None


def _share_projections(layer: nn.Module) -> None:
    """Let the layer's query projection compute the key and value products with its own
    (:class:`_Shared`) where the three are plain maps of one dtype."""
    ms = tuple(getattr(layer.self_attn, n, None) for n in _QKV)
    w = getattr(ms[0], "weight", None)
    if w is not None and all(_bare_linear(m, w.dtype, bias=True) for m in ms):
        _Shared(ms, type(layer.self_attn).__name__).install()


def route_layers(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Give each fusable decoder layer (:func:`_layer_fusable`) whose class passes its
    probe the fused forward; returns the layers routed and, by class, why others were not."""
    routed, why = [], {}
    for name, m in model.named_modules():
        if layer_routed(m):
            routed.append(name)
            continue
        if not _layer_fusable(m):
            continue
        cls = type(m).__name__
        if cls not in why:
            with torch.random.fork_rng(devices=()):     # building the copy draws weights
                why[cls] = _probe_layer(m, prepare=_share_projections)
        if why[cls] is None:
            _share_projections(m)
            m.forward = types.MethodType(_fused_layer_forward, m)
            m._meshlab_layer = True
            routed.append(name)
    return routed, {k: v for k, v in why.items() if v is not None}
