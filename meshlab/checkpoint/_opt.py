"""The optimizer's side of a load: what the checkpoint holds, fitted to this optimizer.

A load gives the optimizer the state the checkpoint holds, as
``torch.optim.Optimizer.load_state_dict`` does: every state tensor saved for a parameter
is read (an SGD built without momentum gets the saved momentum buffers along with the
saved ``momentum``), its values cast as torch casts them (floating state to the
parameter's dtype and device; ``step`` kept unless the group is fused or capturable), and
what the optimizer held before is replaced. The tensors DCP reads into are made from the
checkpoint's metadata, so nothing steps the optimizer to create them.

torch's ``set_optimizer_state_dict`` does not serve here: it names state by the model's
parameters, while ``meshlab.optimizer`` steps tensors that are not parameters (ZeRO-1's
flat slices, offload's host masters), and it creates the state by stepping the optimizer
first. Those go through the parts' hooks (``Part.load_saved_state``, ``tensor_of``).

With ``strict=False`` a parameter whose saved state does not fit (another shape) or is
incomplete keeps its own state, key by key, as its weight does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from . import _state
from ._safe import CheckpointError
from ..core.tensors import local as _local

OPT_PREFIX = _state.OPT_PREFIX


@dataclasses.dataclass
class OptimizerFit:
    """What the load reads for the optimizer and what it then holds (phase 2)."""

    fill: dict[str, torch.Tensor]              # checkpoint key -> tensor DCP reads into
    keys: dict[str, dict[str, str]]            # fqn -> {state key: checkpoint key}
    current: dict[str, torch.Tensor]           # the state kept where nothing fits
    missing: list[str]
    lacking: dict[str, set]                    # fqn -> state keys others have, it lacks
    mismatched: list[tuple]
    used: set[str]                             # checkpoint keys this rank reads
    saved: bool                                # the checkpoint holds an optimizer


def _keys_by_param(names: list[str], saved: dict) -> dict[str, dict[str, str]]:
    """fqn -> {state key: checkpoint key} of what the checkpoint holds for each name (a
    state key has no dot; a parameter's name does)."""
    wanted = set(names)
    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for k in saved:
        if k.startswith(OPT_PREFIX):
            fqn, _, key = k[len(OPT_PREFIX):].rpartition(".")
            if fqn in wanted:
                out[fqn][key] = k
    return out


def _empty(p: torch.Tensor, size: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tensor DCP reads a saved state tensor into: a scalar, or laid out like ``p``."""
    if size == ():
        return torch.zeros((), dtype=dtype)
    loc = _local(p)
    return _state._like(p, torch.empty(loc.shape, dtype=dtype, device=loc.device))


def fit(opt, model: nn.Module, src, strict: bool) -> OptimizerFit:
    """Match the checkpoint's optimizer state to ``opt``'s parameters (no collective but
    the current state's, under ``strict=False``; nothing is written)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if hasattr(opt, "check_checkpointable"):       # owners of whole tensors: refused
        opt.check_checkpointable("meshlab.checkpoint.load")
    md = src.md.state_dict_metadata
    params = _state._params(opt, model)
    record = src.meta.get("optimizer")
    if record is None:               # saved without an optimizer: the optimizer stays
        return OptimizerFit({}, {}, {}, [f"{OPT_PREFIX}{n}" for n, _ in params], {}, [],
                            set(), False)
    keys = _keys_by_param([n for n, _ in params], md)
    if not record.get("has_state", True):    # saved before the first step: no state yet
        keys = {n: {} for n in keys}
    names = {k.rpartition(".")[2] for k in md if k.startswith(OPT_PREFIX)}
    fill, missing, mism = {}, [], []
    lacking = {n: names - set(keys[n]) for n, _ in params}
    for n, p in params:
        missing += [f"{OPT_PREFIX}{n}.{k}" for k in sorted(lacking[n])]
        for key, ck in sorted(keys[n].items()):
            m = md[ck]
            if not isinstance(m, TensorStorageMetadata):
                mism.append((ck, (), tuple(p.shape), type(m).__name__, str(p.dtype)))
            elif tuple(m.size) in ((), tuple(p.shape)):
                fill[ck] = _empty(p, tuple(m.size), m.properties.dtype)
            else:
                mism.append((ck, tuple(m.size), tuple(p.shape), str(m.properties.dtype),
                             str(p.dtype)))
    used = {ck for per in keys.values() for ck in per.values()}
    current = {} if strict else _state.optimizer_state(opt, model)[0]
    return OptimizerFit(fill, keys, current, missing, lacking, mism, used, True)


def final_state(fit_: OptimizerFit, strict: bool) -> dict[str, dict[str, Any]]:
    """fqn -> {state key: checkpoint key, or the current tensor}: what each parameter holds
    after the load (the saved state; under ``strict=False`` a parameter whose saved state
    does not all fit keeps its own where the saved does not fit)."""
    out: dict[str, dict[str, Any]] = {}
    for n, per in fit_.keys.items():
        fits = {k: ck for k, ck in per.items() if ck in fit_.fill}
        if strict or (len(fits) == len(per) and not fit_.lacking.get(n)):
            out[n] = fits
            continue
        prefix = f"{OPT_PREFIX}{n}."
        own = {k[len(prefix):]: v for k, v in fit_.current.items()
               if k.startswith(prefix) and "." not in k[len(prefix):]}
        out[n] = {**own, **fits}
    return out


def check_buckets(opt, model, final: dict, where: str) -> None:
    """Each tensor a part steps for several parameters (a ZeRO-1 slice) takes one set of
    state keys: its parameters must end up holding the same ones."""
    names = {id(p): n for n, p in _state._params(opt, model)}
    for part in _state._parts(opt):
        for b, _ in part.stepped():
            held = [(names[id(p)], sorted(final.get(names[id(p)], {}))) for p in b.params]
            (a, ka), other = held[0], next((x for x in held if x[1] != held[0][1]), None)
            if other is not None:
                raise CheckpointError(
                    f"{where}: the optimizer steps {a} and {other[0]} as one slice (ZeRO-1), "
                    f"but the checkpoint gives them different state ({ka} and {other[1]}); "
                    f"load a checkpoint of this optimizer, or strict=True to see what does "
                    f"not fit")


def _cast(t: torch.Tensor, key: str, v: torch.Tensor, groups: list) -> torch.Tensor:
    """``v`` as ``Optimizer.load_state_dict`` keeps it for the tensor ``t`` it belongs to
    (``_process_value_according_to_param_policy``): ``step`` untouched unless the group is
    fused or capturable; floating state in ``t``'s dtype; on ``t``'s device; a DTensor
    where ``t`` is one."""
    from torch.distributed.tensor import DTensor

    group = next((g for g in groups if any(x is t for x in g["params"])), {})
    device = _local(t).device
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return v.to(dtype=torch.float32, device=device)
        return v
    if isinstance(v, DTensor) and not isinstance(t, DTensor):
        v = _local(v)                   # offload's host master holds the local block
    dtype = t.dtype if t.is_floating_point() else v.dtype
    return v.to(dtype=dtype, device=device)


def set_state(opt, model, values: dict[str, dict[str, torch.Tensor]], rest: dict) -> None:
    """Replace ``opt``'s state with ``values`` (fqn -> {key: tensor}) and its param groups,
    loss scale and step counts with ``rest``'s."""
    inner = getattr(opt, "inner", opt)
    params = _state._params(opt, model)
    names = {id(p): n for n, p in params}
    groups = inner.param_groups
    stepped = [(b, t) for part in _state._parts(opt) for b, t in part.stepped()]
    if stepped:                   # ZeRO-1: each slice's state cut from its parameters'
        for b, shard in stepped:
            per = values.get(names[id(b.params[0])], {})
            inner.state.pop(shard, None)
            if per:
                inner.state[shard] = {k: _cast(shard, k, v if v.dim() == 0 else
                                               torch.zeros_like(shard), groups)
                                      for k, v in per.items()}

        def read(p, key: str) -> torch.Tensor:
            return values[names[id(p)]][key]

        # every part loads its own (a list, not any(): none may be skipped)
        if any([part.load_saved_state(inner.state, read) for part in _state._parts(opt)]):
            opt.refresh_master()
    else:
        key_of = getattr(opt, "tensor_of", lambda p: p)      # offload's host masters
        numbers = rest.get("state_numbers") or {}
        for n, p in params:
            t = key_of(p)
            inner.state.pop(t, None)
            if values.get(n) or numbers.get(n):
                inner.state[t] = {**{k: _cast(t, k, v, groups) for k, v in
                                     values.get(n, {}).items()}, **numbers.get(n, {})}
    if rest.get("param_groups") is not None:     # check_optimizer made sure they fit
        sources = _state.group_sources(opt, model, rest, "the checkpoint")
        for g, saved in zip(groups, (rest["param_groups"][i] for i in sources)):
            g.update({k: tuple(v) if isinstance(g.get(k), tuple) else v
                      for k, v in saved.items()})
    if getattr(opt, "scaler", None) is not None and "scaler" in rest:
        opt.scaler.load_state_dict(rest["scaler"])
    for key in ("steps", "skipped_steps"):
        if isinstance(rest.get(key), int) and hasattr(opt, key):
            setattr(opt, key, rest[key])
