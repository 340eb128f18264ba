"""Parameter groups of ``meshlab.optimizer``: torch-style ``[{'params': [...], **options}]``
over a parallelized model, each parameter named by itself or by its FQN.

A group's options override the optimizer's keyword arguments for its parameters (torch's
rule). Rooms that give the optimizer other tensors than the parameters keep each group
apart: ZeRO-1 buckets never mix two groups, so every fp32 slice steps with its
parameters' options.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..core.errors import ConfigError


# The lists torch's LR schedulers keep one entry a param group in (their state and their
# attributes), which follow the groups where a load or a rebuilt optimizer orders them anew.
SCHEDULER_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs",
                       "base_momentums", "max_momentums")


def _names(entry: Any, by_id: dict, by_name: dict, i: int,
           elsewhere: frozenset = frozenset()) -> list[str]:
    raw = entry.get("params") if isinstance(entry, dict) else None
    if raw is None:
        raise ConfigError(f"optimizer(param_groups=...): group {i} is {entry!r}; each group is "
                          f"a dict with 'params' (parameters or their names) and options, "
                          f"e.g. {{'params': no_decay, 'weight_decay': 0.0}}")
    items = [raw] if isinstance(raw, str) or not isinstance(raw, Iterable) else list(raw)
    out = []
    for x in items:
        name = x if isinstance(x, str) else by_id.get(id(x))
        if name in elsewhere:          # another pipeline rank's: its optimizer steps it
            continue
        if name is None or name not in by_name:
            what = repr(x) if isinstance(x, str) else f"a {type(x).__name__} {tuple(x.shape)}" \
                if hasattr(x, "shape") else repr(x)
            raise ConfigError(f"optimizer(param_groups=...): group {i} holds {what}, which is "
                              f"no trainable parameter of the model; name the parallelized "
                              f"model's parameters (model.named_parameters())")
        out.append(name)
    return out


def group_layout(params: list, param_groups, elsewhere: frozenset = frozenset()
                 ) -> tuple[dict[int, int], list[dict]]:
    """``({id(parameter): group index}, [each group's options])`` for ``params``
    (``[(fqn, parameter)]``, the trainable ones); ``param_groups=None`` is one group.
    Every trainable parameter must be in exactly one group. Names in ``elsewhere`` (the
    model's parameters other pipeline ranks hold) are passed over: groups written for
    the whole model serve every stage."""
    if param_groups is None:
        return {id(p): 0 for _, p in params}, [{}]
    groups = list(param_groups)
    if not groups:
        raise ConfigError("optimizer(param_groups=[]): give at least one group")
    by_id = {id(p): n for n, p in params}
    by_name = dict(params)
    group_of: dict[int, int] = {}
    options: list[dict] = []
    for i, g in enumerate(groups):
        for name in _names(g, by_id, by_name, i, elsewhere):
            p = by_name[name]
            if id(p) in group_of:
                raise ConfigError(f"optimizer(param_groups=...): {name} is in groups "
                                  f"{group_of[id(p)]} and {i}; put each parameter in one group")
            group_of[id(p)] = i
        options.append({k: v for k, v in g.items() if k != "params"})
    missing = [n for n, p in params if id(p) not in group_of]
    if missing:
        raise ConfigError(f"optimizer(param_groups=...): the groups leave out trainable "
                          f"parameters {missing[:3]}{'...' if len(missing) > 3 else ''}; add "
                          f"them to a group, or freeze them (requires_grad=False)")
    return group_of, options


def torch_groups(tensors: list, group_of: dict[int, int], options: list[dict],
                 stepped: list) -> list[dict]:
    """The inner optimizer's ``param_groups`` argument: ``tensors`` (parameters, or the
    slices ``stepped`` pairs with their buckets) split by group, with each group's
    options."""
    bucket_of = {id(t): b for b, t in stepped}
    split: list[list] = [[] for _ in options]
    for t in tensors:
        b = bucket_of.get(id(t))
        i = group_of[id(b.params[0])] if b is not None else group_of[id(t)]
        split[i].append(t)
    # A group that names parameters stays, empty where this rank steps none of them (ZeRO-1
    # owners of whole tensors): every rank keeps the same groups, in the same order.
    named = set(group_of.values())
    return [{"params": ts, **opt} for i, (ts, opt) in enumerate(zip(split, options))
            if i in named]
