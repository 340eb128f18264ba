"""A 4-bit base (``lora(quantize=...)``) in checkpoints: every tensor of it, and its record.

A bitsandbytes 4-bit weight is its packed bytes (a uint8 ``Params4bit``) and a quant state
that is neither a parameter nor a buffer: the per-block scales (``absmax``), the 4-bit
type's code table, and with double quantization the scales' own scales, their code table
and the offset subtracted before they were quantized, beside values that are not tensors
(the 4-bit type, the block sizes, the dtype the weight had, its shape). bitsandbytes'
``state_dict`` keys (``weight.absmax``, ..., ``weight.quant_state.bitsandbytes__nf4``, a
uint8 tensor of JSON whose length varies with the offset's digits) do not round-trip
through ``load_state_dict``: it takes the packed bytes and passes over every other key, so
the offset would keep the value the model had before the load.

meshlab's checkpoints (the sharded ``save``/``load`` and the safetensors exports) hold
instead, for each 4-bit weight ``w``, the tensors themselves under fixed names
(``live``: ``w``, ``w.absmax``, ``w.quant_map`` and, doubly quantized, ``w.nested_absmax``,
``w.nested_quant_map``, ``w.nested_offset``), read into the model's own tensors in
place, and the rest as JSON (``record``: in the checkpoint's marker, in an export's
manifest). A load compares the record with the model's before it writes anything
(``check``): each 4-bit weight loads whole, with every tensor of its state, from a
checkpoint quantized as the model is, or the load raises naming it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ._safe import CheckpointError

_PARTS = ("absmax", "quant_map")
_NESTED = ("nested_absmax", "nested_quant_map", "nested_offset")


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each 4-bit weight of ``model`` by its parameter name (none without bitsandbytes)."""
    if "bitsandbytes" not in sys.modules:       # no 4-bit weight can exist without it
        return {}
    Params4bit = sys.modules["bitsandbytes"].nn.Params4bit
    return {n: p for n, p in model.named_parameters()
            if isinstance(p, Params4bit) and getattr(p, "quant_state", None) is not None}


def _cpu_packed(name: str, p) -> None:
    if getattr(p.quant_state, "packing_format_for_cpu", False):
        raise CheckpointError(
            f"{name} is held in bitsandbytes' CPU inference layout (a forward in eval mode "
            f"without gradients on the CPU repacked it, its scales rounded to bfloat16), "
            f"which is not the quantization the model was made with; checkpoint the model "
            f"before such a forward (evaluate in train mode or with gradients enabled), "
            f"or save its adapters (save_adapter)")


def live(name: str, p) -> dict[str, torch.Tensor]:
    """The tensors that hold 4-bit weight ``name`` (``p``): its packed bytes and its quant
    state, the model's own (a load writes into them in place)."""
    qs = p.quant_state
    out = {name: p.data, f"{name}.absmax": qs.absmax, f"{name}.quant_map": qs.code}
    if qs.nested:
        out[f"{name}.nested_absmax"] = qs.state2.absmax
        out[f"{name}.nested_quant_map"] = qs.state2.code
        out[f"{name}.nested_offset"] = qs.offset
    return out


def names(name: str, nested: bool) -> tuple[str, ...]:
    """The checkpoint names of 4-bit weight ``name``'s tensors."""
    return (name,) + tuple(f"{name}.{k}" for k in _PARTS + (_NESTED if nested else ()))


def canonical(model: nn.Module, sd: dict) -> dict:
    """``sd`` (a state dict of ``model``) with bitsandbytes' keys of each 4-bit weight
    replaced by ``live``'s tensors; any other state dict as it is."""
    four = weights(model)
    if not four:
        return sd
    out = {k: v for k, v in sd.items()
           if not any(k == w or k.startswith(w + ".") for w in four)}
    for w, p in four.items():
        out.update(live(w, p))
    return out


def aux(model: nn.Module) -> set[str]:
    """The names ``canonical`` adds beside the weights (``load_state_dict`` knows none)."""
    return {k for w, p in weights(model).items() for k in live(w, p) if k != w}


def record(model: nn.Module) -> dict:
    """What is not a tensor in each 4-bit weight's quantization, as JSON, by name; raises
    for a weight held in bitsandbytes' CPU inference layout."""
    out = {}
    for w, p in weights(model).items():
        _cpu_packed(w, p)
        qs = p.quant_state
        d = {"quant_type": qs.quant_type, "blocksize": int(qs.blocksize),
             "dtype": str(qs.dtype).removeprefix("torch."),
             "shape": [int(s) for s in qs.shape], "nested": bool(qs.nested),
             "storage": str(p.dtype).removeprefix("torch.")}
        if qs.nested:
            d["nested_blocksize"] = int(qs.state2.blocksize)
            d["nested_dtype"] = str(qs.state2.dtype).removeprefix("torch.")
        out[w] = d
    return out


def check(saved: dict | None, model: nn.Module, source: dict[str, str], where: str) -> None:
    """Before a load writes anything: every 4-bit weight of ``model`` that loads
    (``source``: the model's name -> the checkpoint's) loads with each of its tensors, from
    a weight the checkpoint records as quantized as the model's; a checkpoint's 4-bit
    weight loads into a 4-bit weight only."""
    mine = record(model)
    if saved is not None and not isinstance(saved, dict):
        raise CheckpointError(f"{where}: its record of the 4-bit base is damaged; save the "
                              f"model again")
    saved = saved or {}
    for w, d in mine.items():
        tensors = names(w, d["nested"])
        loads = [n for n in tensors if n in source]
        if not loads:
            continue              # a checkpoint without this weight (the adapters alone)
        key = source.get(w)
        theirs = saved.get(key) if key is not None else None
        if theirs is None:
            raise CheckpointError(
                f"{where}: {w} is a 4-bit weight (lora(quantize=...)), but the checkpoint "
                f"holds {key or loads[0]} without meshlab's record of its quantization "
                f"(bitsandbytes' own state_dict, or full-precision values); a checkpoint "
                f"of this model saved by meshlab (checkpoint.save, save_pretrained) loads "
                f"into it, and full-precision weights load before the base is quantized "
                f"(parallelize(..., state_dict=...), or from_pretrained before boost)")
        if theirs != d:
            differ = sorted(k for k in set(d) | set(theirs) if d.get(k) != theirs.get(k))
            raise CheckpointError(
                f"{where}: {key} was quantized with "
                f"{ {k: theirs.get(k) for k in differ} }, this model's {w} with "
                f"{ {k: d.get(k) for k in differ} }; build the model with the Quantize(...) "
                f"the checkpoint was saved with")
        lacking = [n for n in tensors if n not in source]
        if lacking:
            raise CheckpointError(
                f"{where}: the checkpoint holds {key} but not {lacking} (its quantization "
                f"state); a 4-bit weight loads whole or not at all: load a checkpoint "
                f"meshlab saved whole")
    for name, key in source.items():
        if key in saved and name not in mine:
            raise CheckpointError(
                f"{where}: {key} is a 4-bit weight in the checkpoint, but this model's "
                f"{name} is not; build the model with lora(..., quantize=...) as the "
                f"checkpoint was saved")
