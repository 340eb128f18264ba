"""The canonical state of a model and its optimizer, whatever the parallelism.

Model: parameters keyed by FQN, as DTensors laid out like the model (or plain tensors).
Optimizer: ``optim.<fqn>.<key>`` tensors shaped and laid out like the parameter — where a
runtime part steps tensors of its own (ZeRO-1's flat slices), the part gives them back per
parameter for the save and cuts them again after the load (``Part.state_to_save``,
``Part.load_saved_state``). DCP then reshards between any two
layouts: ZeRO-3 to ZeRO-1, tp=2 to tp=4, or to a single process. The load's side of the
optimizer is ``_opt``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _fourbit
from ._safe import CheckpointError
from ..core.tensors import local as _local
from ..transforms._install import runtime_or_none
from ..train._groups import SCHEDULER_PER_GROUP

OPT_PREFIX = "optim."


def _like(param, local: torch.Tensor):
    """``local`` (this rank's block) laid out like ``param``."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and not isinstance(local, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if runtime_or_none(model) is not None and dist.is_initialized():
        sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=False))
        params = dict(model.named_parameters())
        for fqn, master in _masters(model).items():      # offload's fp32 masters
            sd[fqn] = _like(params[fqn], master)
        return _fourbit.canonical(model, sd)
    # a 4-bit base's weights by their own tensors (``_fourbit``), not bitsandbytes' keys
    return _fourbit.canonical(model, dict(model.state_dict()))


def _parts_of(model: nn.Module) -> tuple:
    """The runtime parts of a parallelized model (none for any other)."""
    rt = runtime_or_none(model)
    return rt.parts if rt is not None else ()


def _masters(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> the fp32 master that holds a parameter's value where the device keeps only
    a compute-dtype copy (``offload`` on one rank under bf16)."""
    out: dict[str, torch.Tensor] = {}
    for part in _parts_of(model):
        out.update(part.model_state())
    return out


def refresh_masters(model: nn.Module) -> None:
    """After a model load: master copies kept by parts (offload) agree with it again."""
    for part in _parts_of(model):
        part.refresh_master()


def set_model_state(model: nn.Module, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # a 4-bit weight's quant state was read into its own tensors (``_fourbit.live``);
    # load_state_dict knows none of those names
    aux = _fourbit.aux(model)
    sd = {k: v for k, v in sd.items() if k not in aux} if aux else sd
    if runtime_or_none(model) is not None and dist.is_initialized():
        masters = _masters(model)
        set_model_state_dict(model, {k: v for k, v in sd.items() if k not in masters},
                             options=StateDictOptions(strict=strict and not masters))
        for fqn, master in masters.items():
            if fqn in sd and sd[fqn] is not master:
                master.copy_(_local(sd[fqn]))
        refresh_masters(model)
    else:
        model.load_state_dict(sd, strict=strict)


def _params(opt, model: nn.Module | None = None) -> list[tuple[str, nn.Parameter]]:
    """(FQN, parameter) of every parameter the optimizer updates."""
    if hasattr(opt, "params"):           # MeshOptimizer
        return list(opt.params)
    if model is None:
        raise CheckpointError("a plain torch optimizer needs its model to name its state")
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer updates a tensor that is not a parameter "
                                      "of the model")
            out.append((names[id(p)], p))
    return out


def _parts(opt) -> tuple:
    """The runtime parts of a ``MeshOptimizer``'s model (none for a plain optimizer)."""
    rt = getattr(opt, "rt", None)
    return rt.parts if rt is not None else ()


def has_state(opt) -> bool:
    """Whether the optimizer holds any state yet (AdamW creates it on its first step)."""
    return any(bool(v) for v in getattr(opt, "inner", opt).state.values())


def group_names(opt, model: nn.Module | None = None) -> list[list[str]]:
    """The FQNs of the parameters in each of the optimizer's param groups, in its order."""
    if hasattr(opt, "_torch_order"):          # MeshOptimizer: its groups as one process's
        names = {id(p): n for n, p in opt.params}
        return [sorted(names[id(p)] for p in ps) for ps in opt._torch_order()]
    names = {id(p): n for n, p in _params(opt, model)}
    return [sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups]


def group_sources(opt, model: nn.Module | None, rest: dict[str, Any], where: str) -> list[int]:
    """For each of ``opt``'s param groups, the saved group whose options it takes: the
    one that held its parameters, by name (a group's options copied by position gave
    each group the other's learning rate and weight decay where the groups were built in
    another order); its own position where the checkpoint names none of them (one saved
    before groups were named, or another pipeline stage's)."""
    n = len(getattr(opt, "inner", opt).param_groups)
    saved = rest.get("group_names")
    if not isinstance(saved, list):
        return list(range(n))
    held = {name: i for i, names in enumerate(saved) if isinstance(names, list)
            for name in names}
    out = []
    for j, names in enumerate(group_names(opt, model)):
        found = sorted({held[x] for x in names if x in held})
        if len(found) > 1:
            raise CheckpointError(
                f"{where}: this optimizer's param group {j} holds parameters the saved run "
                f"kept in groups {found} ({names[0]}, ...); build the param groups as the "
                f"saved run did, or load without the optimizer (optimizer=None)")
        out.append(found[0] if found else j)
    return out


def scheduler_by_groups(saved: Any, sources: list[int] | None, where: str) -> Any:
    """A saved LR scheduler's state with its per-group lists in this optimizer's group
    order (``sources``: :func:`group_sources`, each group's saved group); the lists of
    schedulers chained in ``_schedulers`` likewise. Loaded by position, a scheduler whose
    rates come from ``base_lrs`` gave each group the other's where the groups were built
    in another order. A list of one entry a group under a name not known to be per group
    is refused: it could not be put in order."""
    if sources is None or sources == list(range(len(sources))) or not isinstance(saved, dict):
        return saved
    out = {}
    for k, v in saved.items():
        if k == "_schedulers" and isinstance(v, list):
            out[k] = [scheduler_by_groups(x, sources, where) for x in v]
        elif isinstance(v, list) and len(v) == len(sources):
            if k not in SCHEDULER_PER_GROUP:
                raise CheckpointError(
                    f"{where}: the scheduler's {k!r} has one entry a param group, and this "
                    f"optimizer lists its groups in another order than the saved run; build "
                    f"the param groups in the saved order, or load without the scheduler "
                    f"(scheduler=None)")
            out[k] = [v[i] for i in sources]
        else:
            out[k] = v
    return out


def check_optimizer(opt, rest: dict[str, Any], where: str,
                    model: nn.Module | None = None) -> None:
    """What ``_opt.set_state`` will need from the checkpoint, checked before the
    load writes anything."""
    inner = getattr(opt, "inner", opt)
    groups = rest.get("param_groups")
    if groups is not None and (not isinstance(groups, list) or
                               not all(isinstance(g, dict) for g in groups)):
        raise CheckpointError(f"{where}: the optimizer's param_groups are damaged "
                              f"({type(groups).__name__}); load an older checkpoint")
    if groups is not None and len(groups) != len(inner.param_groups):
        raise CheckpointError(f"{where} has {len(groups)} optimizer param groups, this "
                              f"optimizer {len(inner.param_groups)}; build the optimizer as "
                              f"the saved run did, or load without it (optimizer=None)")
    if getattr(opt, "scaler", None) is not None and rest.get("scaler") is not None and \
            not isinstance(rest["scaler"], dict):
        raise CheckpointError(f"{where}: the loss scaler's state is damaged")
    sources = group_sources(opt, model, rest, where) if groups is not None else []
    if any(not 0 <= i < len(groups) for i in sources):
        raise CheckpointError(f"{where}: the optimizer's group names are damaged; load an "
                              f"older checkpoint")
    for i, own in zip(sources, inner.param_groups):
        differs = same_shape(groups[i], {k: v for k, v in own.items() if k != "params"},
                             "param_groups", common_only=True)
        if differs:
            raise CheckpointError(f"{where}: the optimizer's {differs}; build the optimizer as "
                                  f"the saved run did, or load without it (optimizer=None)")
    numbers = rest.get("state_numbers")
    if numbers is not None and not (isinstance(numbers, dict) and all(
            isinstance(per, dict) and all(type(x) in (int, float, bool) for x in per.values())
            for per in numbers.values())):
        raise CheckpointError(f"{where}: the optimizer's numeric state is damaged; load an "
                              f"older checkpoint")
    for key in ("steps", "skipped_steps"):
        v = rest.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise CheckpointError(f"{where}: the optimizer's {key} is {v!r}, not a count; "
                                  f"load an older checkpoint")


def same_shape(saved: Any, own: Any, what: str, common_only: bool = False) -> str | None:
    """Where the JSON state ``saved`` differs in form from ``own`` (the state the object
    would save now: the same keys, lengths and kinds of value), or None. ``common_only``
    compares only the keys both hold (an optimizer's groups take the saved ones)."""
    def kind(v):
        if v is None or isinstance(v, (bool, str)):
            return type(v).__name__
        if isinstance(v, (int, float)):
            return "number"
        if isinstance(v, (list, tuple)):
            return "list"
        return "object" if isinstance(v, dict) else type(v).__name__

    if common_only and (saved is None or own is None):
        return None                 # an option left to its default (foreach=None, ...)
    if kind(saved) != kind(own):
        return f"{what} is a {kind(saved)} where this one holds a {kind(own)}"
    if isinstance(own, dict):
        # JSON wrote the keys as strings (MultiStepLR's milestones: {30: 1} -> {"30": 1})
        named = {str(k): k for k in own}
        if len(named) != len(own) or not all(isinstance(k, str) for k in saved):
            named = {k: k for k in own}
        keys = set(saved) & set(named) if common_only else set(named)
        if not common_only and set(saved) != set(named):
            return (f"{what} has the keys {sorted(map(repr, saved))}, this one "
                    f"{sorted(map(repr, named))}")
        for k in sorted(keys, key=str):
            differs = same_shape(saved[k], own[named[k]], f"{what}[{k!r}]", common_only)
            if differs:
                return differs
    elif isinstance(own, (list, tuple)):
        if len(saved) != len(own):
            return f"{what} holds {len(saved)} values, this one {len(own)}"
        for i, (a, b) in enumerate(zip(saved, own)):
            differs = same_shape(a, b, f"{what}[{i}]", common_only)
            if differs:
                return differs
    return None


def restored(saved: Any, own: Any) -> Any:
    """``saved`` (read from JSON, checked by ``same_shape``) in the containers of ``own``:
    a dict's keys JSON wrote as strings given back their own type, a ``Counter`` or tuple
    built again (MultiStepLR's milestones are a ``Counter`` of ints)."""
    if isinstance(own, dict) and isinstance(saved, dict):
        named = {str(k): k for k in own}
        if len(named) != len(own):
            named = {k: k for k in own}
        out = {named.get(k, k): restored(v, own.get(named.get(k, k))) for k, v in saved.items()}
        return out if type(own) is dict else type(own)(out)
    if isinstance(own, (list, tuple)) and isinstance(saved, (list, tuple)):
        out = [restored(a, b) for a, b in zip(saved, own)]
        return tuple(out) if isinstance(own, tuple) else out
    return saved


# LR schedulers' counts (whole numbers; ``last_epoch`` starts at -1) and rates (>= 0)
_SCHED_COUNTS = {"last_epoch": -1, "_step_count": 0, "step_size": 1, "total_steps": 1,
                 "total_iters": 0, "T_0": 1, "T_i": 1, "T_mult": 1, "patience": 0,
                 "cooldown": 0, "cooldown_counter": 0, "num_bad_epochs": 0}
_SCHED_RATES = {"base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min", "gamma", "factor",
                "start_factor", "end_factor", "base_momentums", "max_momentums", "eps",
                "default_min_lr", "max_lr", "initial_lr", "min_lr", "total_size",
                "step_ratio"}
_SCHED_INFINITE = {"best", "mode_worse"}     # ReduceLROnPlateau's best before any metric


def check_scheduler(saved: Any, own: Any, what: str = "scheduler state",
                    key: Any = None) -> str | None:
    """Where a learning-rate scheduler's saved state (of ``own``'s form, ``same_shape``)
    holds a value the scheduler would misread, or None: a setting (a string: a mode, an
    annealing function, the name of a group's option; or a flag) other than the
    scheduler's, a number that is NaN or infinite, a count that is not a whole number in
    its range, a rate below 0. The scheduler would take any of them and fail at a later
    step (a ``KeyError``, a ``ValueError``) or set NaN or negative learning rates."""
    import math

    if isinstance(own, dict) and isinstance(saved, dict):
        named = {str(k): k for k in own}
        for k in sorted(saved, key=str):
            o = own.get(k, own.get(named.get(k), None))
            bad = check_scheduler(saved[k], o, f"{what}[{k!r}]", k)
            if bad:
                return bad
        return None
    if isinstance(own, (list, tuple)) and isinstance(saved, (list, tuple)):
        for i, (a, b) in enumerate(zip(saved, own)):
            bad = check_scheduler(a, b, f"{what}[{i}]", key)
            if bad:
                return bad
        return None
    if isinstance(own, (str, bool)) and saved != own:
        return (f"{what} is {saved!r} where this scheduler holds {own!r} (a setting, "
                f"not a state the run changes)")
    if isinstance(saved, (int, float)) and not isinstance(saved, bool):
        if math.isnan(saved) or math.isinf(saved) and not (
                key in _SCHED_INFINITE or saved == own):
            return f"{what} is {saved!r}, not a finite number"
        if key in _SCHED_COUNTS and isinstance(own, int) and not isinstance(own, bool) and (
                not isinstance(saved, int) or saved < _SCHED_COUNTS[key]):
            return (f"{what} is {saved!r}, not a whole number >= {_SCHED_COUNTS[key]} "
                    f"(a count)")
        if key in _SCHED_RATES and saved < 0:
            return f"{what} is {saved!r}, below 0 (a rate)"
    return None


def optimizer_state(opt, model: nn.Module | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors for DCP, JSON-able rest: param groups, state kept as numbers (an
    optimizer's integer step), the loss scaler)."""
    if hasattr(opt, "check_checkpointable"):       # owners of whole tensors: refused
        opt.check_checkpointable("meshlab.checkpoint.save")
    inner = getattr(opt, "inner", opt)
    tensors: dict[str, torch.Tensor] = {}
    numbers: dict[str, dict[str, Any]] = {}     # state kept as Python numbers, by parameter
    owned = [got for got in (part.state_to_save(inner.state) for part in _parts(opt))
             if got is not None]
    if owned:                            # parts step tensors of their own (ZeRO-1)
        names = {id(p): n for n, p in opt.params}
        for p, key, t in (x for got in owned for x in got):
            tensors[f"{OPT_PREFIX}{names[id(p)]}.{key}"] = t if t.dim() == 0 else _like(p, t)
    else:
        key_of = getattr(opt, "tensor_of", lambda p: p)        # offload's host masters
        for name, p in _params(opt, model):
            for key, v in inner.state.get(key_of(p), {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{OPT_PREFIX}{name}.{key}"] = v if v.dim() == 0 else _like(p, v)
                elif type(v) in (int, float, bool):     # a step count kept as a number
                    numbers.setdefault(name, {})[key] = v
                else:
                    raise CheckpointError(
                        f"the optimizer's state {key!r} of {name} is a {type(v).__name__}; a "
                        f"checkpoint keeps an optimizer's tensors and numbers (int, float, "
                        f"bool). Keep it as a tensor in the optimizer, or save without the "
                        f"optimizer (optimizer=None) and rebuild it")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    rest: dict[str, Any] = {"param_groups": _jsonable(groups, "optimizer param_groups"),
                            "group_names": group_names(opt, model)}
    if numbers:
        rest["state_numbers"] = numbers
    if getattr(opt, "scaler", None) is not None:
        rest["scaler"] = opt.scaler.state_dict()
    for key in ("steps", "skipped_steps"):       # meshlab.optimizer's step counts
        if isinstance(getattr(opt, key, None), int):
            rest[key] = getattr(opt, key)
    return tensors, rest


def check_extra(extra: Any) -> None:
    """``extra`` is the user's own state: a JSON object with string keys."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise CheckpointError(f"save(extra=...) takes a dict of JSON values (such as "
                              f"{{'step': 100}}), got a {type(extra).__name__}: {extra!r:.80}; "
                              f"wrap it, e.g. extra={{'value': ...}}")
    bad = [k for k in extra if not isinstance(k, str)]
    if bad:
        raise CheckpointError(f"save(extra=...): keys must be strings (JSON would turn "
                              f"{bad[:3]} into strings and the load would not give them back)")
    _jsonable(extra, "extra")


def _jsonable(v: Any, what: str) -> Any:
    try:
        json.dumps(v)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serializable ({e}); meshlab stores "
                              f"everything but tensors as JSON so that loading runs no code")
    return v
