"""trace: read a module's parameters (on any device, meta included) into a Plan."""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import torch
from torch import nn

from .plan import ActivationEntry, ModelInfo, ModuleInfo, ParamEntry, Plan, dtype_name

_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "tie_word_embeddings", "n_embd", "n_head", "n_layer", "n_inner",
                "max_position_embeddings", "num_local_experts", "num_experts",
                "num_experts_per_tok", "n_routed_experts")


def _config_subset(config: Any) -> tuple:
    out = []
    for k in _CONFIG_KEYS:
        v = getattr(config, k, None)
        if v is not None:
            try:
                json.dumps(v)
            except TypeError:
                continue
            out.append((k, v))
    impl = getattr(config, "_attn_implementation", None)     # the model's own attention
    if isinstance(impl, str):
        out.append(("attn_implementation", impl))
    return tuple(out)


def _blocks(model: nn.Module) -> tuple[str, ...]:
    """FQNs of the repeated blocks: HF ``_no_split_modules`` classes, else the longest
    ``nn.ModuleList`` of identical module types."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found: dict[str, list[str]] = {}
        for n, m in model.named_modules():
            if type(m).__name__ in names:
                found.setdefault(type(m).__name__, []).append(n)
        if found:
            # The repeated block is the class with most instances (BERT also lists its
            # embeddings module, which appears once).
            return tuple(max(found.values(), key=len))
    best: tuple[str, ...] = ()
    for n, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and \
                len({type(c) for c in m}) == 1:
            best = tuple(f"{n}.{i}" if n else str(i) for i in range(len(m)))
    return best


def _module_kind(m: nn.Module) -> str:
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, nn.Embedding):
        return "embedding"
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):   # GPT-2's (in, out) linear
        return "conv1d"
    return ""


def _modules(model: nn.Module) -> tuple[ModuleInfo, ...]:
    """Every module's kind and integer attributes (the layout reads head counts, feature
    sizes and split sizes from them), so that checks need no module."""
    out = []
    for name, m in model.named_modules():
        ints = tuple((k, v) for k, v in vars(m).items()
                     if type(v) is int and not k.startswith("_"))
        if isinstance(getattr(m, "is_causal", None), bool):   # an attention's masking
            src = vars(sys.modules.get(type(m).__module__) or types)
            ints += (("is_causal", int(m.is_causal)),      # and whether it dispatches
                     ("attention_interface", int("ALL_ATTENTION_FUNCTIONS" in src)))
        if isinstance(getattr(m, "track_running_stats", None), bool):   # a norm's
            ints += (("track_running_stats", int(m.track_running_stats)),)  # running stats
        if hasattr(type(m), "_apply_gate"):       # transformers' ExpertsInterface layout
            ints += (("experts_interface", 1),) + tuple(
                (k, int(getattr(m, k))) for k in ("has_gate", "has_bias", "is_transposed",
                                                   "is_concatenated", "has_post_expert_norm")
                if isinstance(getattr(m, k, None), bool))
        out.append(ModuleInfo(name, type(m).__name__, _module_kind(m), ints))
    return tuple(out)


def _head(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)


def trace(model: nn.Module, example_inputs: tuple | dict | None = None) -> Plan:
    """A replicated plan of ``model``: every parameter with its shape and dtype.

    Reads parameters only, so a model on the meta device (too big for any one process)
    traces in milliseconds. Tied parameters (one tensor under two names) are recorded
    once, the second name pointing at the first. With ``example_inputs``, the model is
    run once on the meta device to record the output shape of every repeated block.
    """
    seen: dict[int, str] = {}
    entries = []
    owner = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, _ in mod.named_parameters(recurse=False, remove_duplicate=False):
            owner.setdefault(f"{mname}.{pname}" if mname else pname, mname)
    for fqn, p in model.named_parameters(remove_duplicate=False):
        tied = seen.get(id(p))
        if tied is None:
            seen[id(p)] = fqn
        entries.append(ParamEntry(fqn=fqn, shape=tuple(p.shape), dtype=dtype_name(p.dtype),
                                  requires_grad=p.requires_grad, tied_to=tied,
                                  module=owner.get(fqn, "")))
    config = getattr(model, "config", None)
    tp_plan = getattr(config, "base_model_tp_plan", None) or {}
    info = ModelInfo(
        cls=type(model).__name__,
        model_type=getattr(config, "model_type", None),
        base_prefix=getattr(model, "base_model_prefix", "") if config is not None and
        hasattr(model, getattr(model, "base_model_prefix", "") or "\0") else "",
        blocks=_blocks(model),
        config=_config_subset(config) if config is not None else (),
        tp_plan=tuple((k, v) for k, v in tp_plan.items() if isinstance(v, str)),
        modules=_modules(model),
        head=_head(model),
    )
    acts = ()
    if example_inputs is not None:
        acts = _trace_activations(model, info.blocks, example_inputs)
    return Plan(params=tuple(entries), activations=acts, model=info, source=model)


def _trace_activations(model: nn.Module, blocks, example_inputs) -> tuple:
    shapes: dict[str, tuple] = {}
    hooks = []
    mods = dict(model.named_modules())
    for b in blocks:
        def hook(_m, _i, out, _b=b):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor):
                shapes[_b] = tuple(t.shape)
        hooks.append(mods[b].register_forward_hook(hook))
    try:
        meta_model = model
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                meta_model(**example_inputs)
            else:
                meta_model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return tuple(ActivationEntry(module=b, shape=shapes.get(b)) for b in blocks)
