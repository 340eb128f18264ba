"""A pre-norm decoder layer's middle residual add in its second norm's kernel, and the
closeness test every routing probe of fuse applies (:func:`probe_difference`).

Part of fuse's ``rms_norm`` routing (``_hf``): a layer with Llama's parts
(``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``) whose norm
is routed gets an instance ``forward`` that runs ``residual + attention`` and the norm
after it as one ``meshlab::add_rms_norm``, where a probe of the layer's class (a small
copy run through its own forward and the fused one) agrees. Other layers keep their own
forward, and the report says why.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import Tensor, nn

from ..._errors import ConfigError


_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


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


def norm_eps(m: nn.Module) -> float:
    """The epsilon of a routed RMS norm module, read from the attribute its rule names."""
    return float(getattr(m, m._meshlab_norm.eps))


def _fused_layer_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """A pre-norm decoder layer (norm, attention, residual add, norm, MLP, residual add)
    whose middle add and the norm after it are one ``meshlab::add_rms_norm``. Positional
    extras, or a sum the op does not take (dtypes or shapes that differ, DTensors), run the
    class's own forward or the two steps apart: the same math."""
    from torch.distributed.tensor import DTensor

    from ...ops.rms_norm import add_rms_norm

    if args:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    residual = hidden_states
    h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    if h.dtype != residual.dtype or h.shape != residual.shape or \
            any(isinstance(t, DTensor) for t in (h, residual, norm.weight)):
        hidden = residual + h
        normed = norm(hidden)
    else:
        normed, hidden = add_rms_norm(h, residual, norm.weight, norm_eps(norm))
    return hidden + self.mlp(normed)


def _layer_fusable(m: nn.Module) -> bool:
    """A module with a pre-norm decoder layer's parts, its post-attention norm routed with
    no weight offset, and the class's own ``forward`` (no instance wrapper of another
    room, such as tensor parallelism's, to keep)."""
    if not all(isinstance(getattr(m, a, None), nn.Module) for a in _LAYER):
        return False
    rule = getattr(m.post_attention_layernorm, "_meshlab_norm", None)
    return rule is not None and not rule.offset and "forward" not in vars(m)


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
        norm = clone.post_attention_layernorm
        norm._meshlab_norm = getattr(m.post_attention_layernorm, "_meshlab_norm")
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


def route_layers(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Give each fusable decoder layer (:func:`_layer_fusable`) whose class passes its
    probe the fused forward; returns the layers routed and, by class, why others were not."""
    routed, why = [], {}
    for name, m in model.named_modules():
        if getattr(m, "_meshlab_layer", False):
            routed.append(name)
            continue
        if not _layer_fusable(m):
            continue
        cls = type(m).__name__
        if cls not in why:
            with torch.random.fork_rng(devices=()):     # building the copy draws weights
                why[cls] = _probe_layer(m)
        if why[cls] is None:
            m.forward = types.MethodType(_fused_layer_forward, m)
            m._meshlab_layer = True
            routed.append(name)
    return routed, {k: v for k, v in why.items() if v is not None}
