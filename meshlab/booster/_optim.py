"""The optimizers Colossal-AI scripts build, and how ``boost`` rebuilds any optimizer over
the parallelized parameters.

``HybridAdam``, ``CPUAdam`` and ``FusedAdam`` are real torch optimizers (Adam, or AdamW in
``adamw_mode``), so a script can build a learning-rate scheduler on one before ``boost``.
``boost`` replaces every optimizer by ``meshlab.optimizer(model, cls, **hyper-parameters)``
over the sharded parameters — where the state lives (device, host under ``offload``,
sharded under ZeRO) is the transforms' business, not the optimizer class's — and points
the scheduler at the new one.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..core.errors import ConfigError, ConfigTypeError
from ._args import UnsupportedArgument


class _ColossalAdam:
    """Colossal-AI's Adam arguments on a torch Adam/AdamW."""

    owner = "HybridAdam"

    def _meshlab_init(self, lr, bias_correction, betas, eps, weight_decay, adamw_mode,
                      nvme_offload_fraction=0.0, nvme_offload_dir=None, amsgrad=False):
        if not bias_correction:
            raise UnsupportedArgument(self.owner, "bias_correction", False, "Adam without bias "
                                      "correction is not implemented", "torch.optim.AdamW")
        if nvme_offload_fraction or nvme_offload_dir is not None:
            raise UnsupportedArgument(self.owner, "nvme_offload_fraction",
                                      nvme_offload_fraction, "NVMe offload is not implemented",
                                      "offload(optimizer=1.0) (host memory)")
        kw = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        if amsgrad:
            kw["amsgrad"] = True
        self.meshlab_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        self.meshlab_kwargs = kw
        return kw


class HybridAdam(_ColossalAdam, torch.optim.Adam):
    """Colossal-AI's ``HybridAdam``: Adam (decoupled weight decay, AdamW, with
    ``adamw_mode``, the default). Under
    ``offload`` meshlab steps the host part with its CPU AdamW and the device part with
    torch's, as HybridAdam does."""

    owner = "HybridAdam"

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0, adamw_mode=True, nvme_offload_fraction=0.0,
                 nvme_offload_dir=None, **defaults: Any):
        if defaults:
            raise ConfigTypeError(f"{self.owner}: unknown arguments {sorted(defaults)}")
        kw = self._meshlab_init(lr, bias_correction, betas, eps, weight_decay, adamw_mode,
                                nvme_offload_fraction, nvme_offload_dir)
        torch.optim.Adam.__init__(self, model_params, **kw, decoupled_weight_decay=adamw_mode)


class CPUAdam(HybridAdam):
    """Colossal-AI's ``CPUAdam``: the same update; put the state on the host with
    ``offload(optimizer=1.0)`` (``cpu_offload=True`` of the plugins)."""

    owner = "CPUAdam"


class FusedAdam(_ColossalAdam, torch.optim.Adam):
    """Colossal-AI's ``FusedAdam``: torch's AdamW (``fused=True`` on CUDA)."""

    owner = "FusedAdam"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adamw_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        if not set_grad_none:
            raise UnsupportedArgument(self.owner, "set_grad_none", False, "zero_grad sets "
                                      "gradients to None", "optimizer.zero_grad(set_to_none=True)")
        kw = self._meshlab_init(lr, bias_correction, betas, eps, weight_decay, adamw_mode,
                                amsgrad=amsgrad)
        torch.optim.Adam.__init__(self, params, **kw, decoupled_weight_decay=adamw_mode)
        self.meshlab_fused = True


_GROUP_KEYS = ("params", "initial_lr", "param_names")


def recipe(opt: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[type, dict]:
    """(class, keyword arguments) that rebuild ``opt`` over ``model``'s parameters: the
    class and the hyper-parameters of its first group that holds a trainable parameter
    (their current values: a scheduler built on it may have set the learning rate; a
    group of frozen parameters only is left out of the rebuilt optimizer, and its options
    had become the trainable group's). ``groups`` gives the rest."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigTypeError(f"boost(optimizer=...): a torch.optim.Optimizer, got "
                              f"{type(opt).__name__}")
    held = [p for g in opt.param_groups for p in g["params"]]
    mine = {id(p) for p in held}
    ours = {id(p) for p in model.parameters()}
    foreign = [p for p in held if id(p) not in ours]
    if foreign:
        # boost rebuilds the optimizer over the model's parameters: one holding others'
        # would train what it was not built over, and leave those it was untrained
        what = ("none of the model's parameters (it was built over another model?)"
                if len(foreign) == len(held) else
                f"{len(foreign)} parameters that are not the model's "
                f"(shapes {[tuple(p.shape) for p in foreign[:3]]}"
                f"{'...' if len(foreign) > 3 else ''})")
        raise ConfigError(f"boost(optimizer=...): the optimizer holds {what}; boost trains "
                          f"the model's parameters only: build it over model.parameters() "
                          f"of the model passed to boost, and give another module's "
                          f"parameters an optimizer of their own or make that module part "
                          f"of the model")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in mine]
    if missing:
        raise ConfigError(f"boost(optimizer=...): the optimizer leaves out trainable "
                          f"parameters {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                          f"build it over model.parameters(), or freeze those "
                          f"(requires_grad=False)")
    cls = getattr(opt, "meshlab_class", type(opt))
    first = opt.param_groups[(trained_groups(opt) or [0])[0]]
    if getattr(opt, "meshlab_kwargs", None) is not None:
        kwargs = dict(opt.meshlab_kwargs)
        kwargs["lr"] = first["lr"]
        if getattr(opt, "meshlab_fused", False) and torch.cuda.is_available():
            kwargs["fused"] = True
    else:
        # The group's hyper-parameters that the class's constructor takes (a group also
        # holds keys a subclass fixes: AdamW's decoupled_weight_decay).
        import inspect

        takes = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in first.items() if k not in _GROUP_KEYS and k in takes}
        for k in ("foreach", "fused", "capturable", "differentiable"):
            if kwargs.get(k) in (None, False):
                kwargs.pop(k, None)
    return cls, kwargs


def groups(opt: torch.optim.Optimizer, model: torch.nn.Module, kwargs: dict) -> list | None:
    """Each group of ``opt`` as ``{'params': [FQN, ...], **options differing from
    kwargs}`` (None for one group: ``kwargs`` says it all)."""
    # Group options the constructor does not take but the optimizer reads from its groups
    # (GaLore's ``rank``, ...): carried as they are.
    extra = getattr(opt, "meshlab_group_keys", ())
    carried = any(k in g for g in opt.param_groups for k in extra)
    if (len(opt.param_groups) == 1 and not carried) or \
            not any(p.requires_grad for p in model.parameters()):
        return None
    name = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in opt.param_groups:
        fqns = [name[id(p)] for p in g["params"] if id(p) in name and p.requires_grad]
        diff = {k: (tuple(v) if k == "betas" else v) for k, v in g.items()
                if (k in kwargs and v != kwargs[k]) or k in extra}
        if fqns:
            out.append({"params": fqns, **diff})
    return out if len(out) > 1 or carried else None


def trained_groups(opt: torch.optim.Optimizer) -> list[int]:
    """The positions of ``opt``'s groups that hold a trainable parameter: the groups of the
    optimizer boost rebuilds (``groups``), in order."""
    return [i for i, g in enumerate(opt.param_groups)
            if any(p.requires_grad for p in g["params"])]


def _with_inner(sched) -> list:
    """``sched`` and the schedulers it steps: a warm-up scheduler's ``after_scheduler``,
    torch's ``SequentialLR`` and ``ChainedScheduler``'s ``_schedulers``."""
    out = [sched]
    for s in [getattr(sched, "after_scheduler", None), *getattr(sched, "_schedulers", ())]:
        if s is not None and s is not sched:
            out += _with_inner(s)
    return out


def rebind_scheduler(sched, old: torch.optim.Optimizer, new: torch.optim.Optimizer,
                     kept: list[int]) -> None:
    """Point ``sched`` (built on ``old``) at ``new``: each new group takes from the old
    group it was built from (``kept[j]`` for new group ``j``: ``trained_groups`` read
    before ``parallelize`` renewed the parameters; a group of frozen parameters only is
    gone) the learning rate and what schedulers keep in a group (``initial_lr``,
    OneCycleLR's ``max_lr``, ...), and the schedulers' per-group lists follow the groups;
    ``new.step`` is counted as torch's schedulers count it."""
    import functools

    from ..train._groups import SCHEDULER_PER_GROUP

    if getattr(sched, "optimizer", None) is not old:
        raise ConfigError("boost(lr_scheduler=...): the scheduler was built on another "
                          "optimizer than the one passed to boost; build it on that one")
    if len(kept) != len(new.param_groups):
        raise ConfigError(f"boost(lr_scheduler=...): the rebuilt optimizer has "
                          f"{len(new.param_groups)} param groups for the {len(kept)} of the "
                          f"optimizer passed that hold trainable parameters; build the "
                          f"scheduler after boost, on the optimizer it returns")
    for i, g_new in zip(kept, new.param_groups):
        g_old = old.param_groups[i]
        for k, v in g_old.items():
            if k == "lr" or (k != "params" and k not in g_new):
                g_new[k] = v
    n = len(old.param_groups)
    for s in _with_inner(sched):          # a phased scheduler steps the one inside it
        if getattr(s, "optimizer", None) is old:
            s.optimizer = new
            for k in SCHEDULER_PER_GROUP:
                v = getattr(s, k, None)
                if isinstance(v, list) and len(v) == n and kept != list(range(n)):
                    setattr(s, k, [v[i] for i in kept])
    step = new.step
    if not hasattr(step, "_wrapped_by_lr_sched"):
        ref = weakref.ref(new)

        @functools.wraps(step)
        def counted(*args, **kwargs):
            o = ref()
            if o is not None:
                o._opt_called = True
            return step(*args, **kwargs)

        counted._wrapped_by_lr_sched = True
        new.step = counted
