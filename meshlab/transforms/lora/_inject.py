"""peft's adapters put into the model before it is initialized, as the plan said."""

from __future__ import annotations

import math

import torch

from ...core.errors import ConfigError


def inject(t, ctx) -> None:
    from ._peft import peft_module

    peft = peft_module()
    model = ctx.model
    meta = any(p.is_meta for p in model.parameters())
    device = "meta" if meta else next(model.parameters()).device
    from ._peft import with_targets

    config = with_targets(t.config, ctx.plan.model.config_get("model_type"))
    with torch.device(device):
        peft.inject_adapter_in_model(config, model)
    _base_dtype(model)
    _freeze_as_planned(t, ctx.plan, model)
    if meta:     # right after each wrapper is initialized, before its block is sharded
        ctx.on_module.append(lambda _name, m: start(m))
    else:
        g = torch.Generator().manual_seed(0)
        for m in model.modules():
            start(m, generator=g)


def _base_dtype(model) -> None:
    """Each adapter in its base weight's floating dtype, as the plan lists it (peft makes
    them in torch's default dtype on the meta device: float32 adapters on a float64
    model)."""
    from peft.tuners.lora import LoraLayer

    for m in model.modules():
        if isinstance(m, LoraLayer):
            dt = getattr(m.get_base_layer(), "weight", None)
            dt = dt.dtype if dt is not None else None
            if dt is not None and dt.is_floating_point:
                for adapters in (m.lora_A, m.lora_B):
                    for a in adapters.values():
                        a.to(dt)


def start(m, generator=None) -> None:
    """An adapter wrapper's starting values, the same on every rank: B zero (the model
    starts equal to its base), A from the seeded initialization (or, for a model with real
    weights, Kaiming-uniform from a fixed generator, as peft draws it); a module to save
    starts as a copy of the original."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    with torch.no_grad():
        if isinstance(m, LoraLayer):
            for name in m.lora_A:
                if generator is not None:
                    torch.nn.init.kaiming_uniform_(m.lora_A[name].weight, a=math.sqrt(5),
                                                   generator=generator)
                m.lora_B[name].weight.zero_()
        elif isinstance(m, ModulesToSaveWrapper):
            for copy in m.modules_to_save.values():
                copy.load_state_dict(m.original_module.state_dict())


def inject_quantized(t, ctx) -> None:
    """QLoRA's install, once the weights hold their values (``quantized_with_adapters`` on
    the mesh's device)."""
    from .._install import mesh_device

    quantized_with_adapters(t, ctx.plan, ctx.model, mesh_device(ctx.mesh))


def quantized_with_adapters(t, plan, model, device) -> None:
    """The Linear layers ``plan`` records as 4-bit (``'nf4'``/``'fp4'`` entries) quantized
    on ``device``, then peft's adapters injected (its ``Linear4bit`` layer around each
    quantized target), frozen as planned, and started as ``start`` says from a fixed
    generator (the same on every rank)."""
    from ...core.units import PACKED_4BIT
    from ._peft import peft_module, with_targets
    from ._quant import quantize_model

    peft = peft_module()
    # the plan names each weight as peft leaves it (``<module>.base_layer.weight``); before
    # the injection the module is ``<module>``
    names = [e.module.removesuffix(".base_layer") for e in plan.params
             if e.dtype in PACKED_4BIT]
    quantize_model(t.quantize, model, names, device)
    peft.inject_adapter_in_model(with_targets(t.config, plan.model.config_get("model_type")),
                                 model)
    _freeze_as_planned(t, plan, model)
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        start(m, generator=g)


def single_process(t, plan, model, init) -> torch.nn.Module:
    """``model`` (a copy the caller owns) as one process trains this plan's adapters,
    started as the room starts them: what a layout with adapters is checked against
    (``meshlab.verify``). ``init(model, on_module)`` gives the weights their values (a
    model on the meta device is initialized from the layout's seed, ``on_module(m)`` run
    right after each module; a model with values keeps them) and returns the model."""
    from ._peft import peft_module, with_targets

    if t.quantize is not None:
        model = init(model, None)
        quantized_with_adapters(t, plan, model, next(model.parameters()).device)
        return model
    meta = any(p.is_meta for p in model.parameters())
    peft_module().inject_adapter_in_model(
        with_targets(t.config, plan.model.config_get("model_type")), model)
    model = init(model, start if meta else None)
    if not meta:
        g = torch.Generator().manual_seed(0)
        for m in model.modules():
            start(m, generator=g)
    _freeze_as_planned(t, plan, model)
    return model


def _freeze_as_planned(t, plan, model) -> None:
    got = dict(model.named_parameters())
    # a tied head is its embedding's parameter, listed once by the model (the plan lists
    # both names)
    want = {e.fqn: e for e in plan.params
            if not (e.tied_to and e.fqn not in got and e.tied_to in got)}
    if set(got) != set(want):
        raise ConfigError(
            f"{t!r}: peft wrapped other parameters than the plan predicted (in the model, not "
            f"the plan: {sorted(set(got) - set(want))[:4]}; in the plan, not the model: "
            f"{sorted(set(want) - set(got))[:4]}); narrow target_modules to Linear modules")
    for n, p in got.items():
        p.requires_grad_(want[n].requires_grad)
