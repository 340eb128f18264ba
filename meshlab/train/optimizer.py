"""``optimizer``: a torch optimizer with what only the whole mesh can add.

Gradients are synchronized by the backward itself (each room's ``Reduction``, run by
``GradSync``), so a plain ``torch.optim.AdamW(model.parameters())`` trains a
parallelized model correctly. ``meshlab.optimizer`` adds, in ``step()``: ZeRO-1's
reduce-scatter into fp32 slices and all-gather back (``Part.sync_grads`` /
``after_step``), unscaling and the overflow check agreed by every rank (fp16 loss
scaling), gradient-norm clipping over every mesh axis, and the skip of a step whose
global gradient norm is NaN or infinite (``nonfinite``). It is a
``torch.optim.Optimizer``: learning-rate schedulers, ``param_groups``,
``state_dict()``/``load_state_dict()`` and step hooks work as with the optimizer inside.

Across ranks, ``step()`` first agrees on every group's hyper-parameters (a rank at another
learning rate would move its replica away from the others, silently), and every
``check_replicas`` steps compares the replicas' parameters (``_content``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections import OrderedDict
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from ..core.errors import ConfigError, NonFiniteError, check_int
from ..core.tensors import local as _local, shard_groups
from ..transforms._gradsync import mark_mesh_optimizer
from ..transforms._install import runtime_of
from ..transforms.precision import PrecisionPart
from ._groups import group_layout, torch_groups
from ._content import CHECK_EVERY, agree_hyperparameters, check_replicas as _check_replicas


_NONFINITE = (None, "skip", "raise")

# Optimizers whose update of each element reads that element's gradient and state only, so
# they step a flat slice of a parameter exactly as they step the whole of it (ZeRO-1's fp32
# slices). Those that reduce over a tensor (Adafactor's factored moments, LAMB's and LARS's
# trust ratios, Muon's and Shampoo's whole-matrix preconditioners) would compute those
# reductions over each slice instead: on slices they are refused, never run.
ELEMENTWISE: list[type] = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                           torch.optim.Adamax, torch.optim.Adagrad, torch.optim.Adadelta,
                           torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam,
                           torch.optim.RAdam, torch.optim.ASGD]


def _meshlab_elementwise() -> list[type]:
    from ..ops.cpu_adam import CPUAdamW
    from ..ops.fused_adamw import FusedAdamW
    from ..transforms.offload._hybrid import HybridAdamW

    return [FusedAdamW, CPUAdamW, HybridAdamW]


def register_elementwise(cls: type) -> type:
    """Declare that optimizer ``cls`` updates every element from that element's gradient
    and state alone, so ZeRO-1 may hand it flat slices of parameters; returns ``cls``
    (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"register_elementwise({cls!r}): give a torch.optim.Optimizer class")
    if cls not in ELEMENTWISE:
        ELEMENTWISE.append(cls)
    return cls


def elementwise(cls: type) -> bool:
    """Whether ``cls`` (or a class it derives from) is known to update elementwise."""
    return any(issubclass(cls, e) for e in ELEMENTWISE + _meshlab_elementwise())


def _refuse_on_slices(cls: type, owner) -> None:
    """A part hands the optimizer slices of parameters (ZeRO-1): refuse an optimizer that
    is not known to update elementwise, by name and with the fixes."""
    if elementwise(cls):
        return
    raise ConfigError(
        f"optimizer {cls.__name__} under {type(owner).__name__.removesuffix('Part')}: this "
        f"room steps flat slices of the parameters, and {cls.__name__} is not known to "
        f"update elementwise (factored moments, trust ratios or whole-matrix "
        f"preconditioners would be computed over each slice, not the tensor: the weights "
        f"would silently differ from one process). Use an elementwise optimizer (SGD, "
        f"Adam, AdamW, Adagrad, RMSprop, ...), drop zero_shard(1) (zero_shard(3) and plain "
        f"data parallelism step whole tensors or DTensors), or, if {cls.__name__} does "
        f"update each element alone, declare it with "
        f"meshlab.train.optimizer.register_elementwise({cls.__name__})")


# Optimizers whose update DTensor cannot compute on DTensor parameters (tensor parallelism,
# ZeRO-3): refused by name before any step, where torch would stop inside the update.
_NOT_ON_DTENSORS = {
    torch.optim.Adafactor: "its factored second moment squares a row norm in place "
                           "(aten.pow_ on a pending reduction), which DTensor refuses",
}


def _refuse_on_dtensors(cls: type, tensors) -> None:
    from torch.distributed.tensor import DTensor

    why = next((w for c, w in _NOT_ON_DTENSORS.items() if issubclass(cls, c)), None)
    if why is not None and any(isinstance(t, DTensor) for t in tensors):
        raise ConfigError(f"optimizer {cls.__name__} on DTensor parameters (tensor parallelism "
                          f"or zero_shard(3)): {why}. Use an elementwise optimizer (AdamW, "
                          f"...) or torch.optim.Muon, shown to train these layouts as one "
                          f"process, or lay the model out with data parallelism alone")


def _params_of(cls) -> set[str]:
    try:
        return set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return set()


class _Holder:
    """A gradient where ``clip_grads_with_norm_`` looks for one (``.grad``): the tensors
    clipped are the local gradients the parts hand over (ZeRO-1's slices, offload's host
    copies), not parameters' ``.grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def _norm32(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` as one float32 scalar: ``get_total_norm`` over fp32 (and
    wider) ones, and fp16/bf16 ones through per-tensor norms accumulated and returned in
    float32 (``get_total_norm`` would round each to its dtype)."""
    wide = [g for g in grads if g.dtype.itemsize >= 4]
    parts = [get_total_norm(wide).float()] if wide else []
    narrow: dict = {}
    for g in grads:
        if g.dtype.itemsize < 4:
            narrow.setdefault(g.device, []).append(g)
    for gs in narrow.values():
        parts += torch._foreach_norm(gs, 2.0, dtype=torch.float32)
    return parts[0] if len(parts) == 1 else get_total_norm(parts)


class MeshOptimizer(torch.optim.Optimizer):
    """A torch optimizer driven the way a parallelized model needs (see module doc).

    It holds the optimizer it was built with as ``inner`` and shares its
    ``param_groups`` and ``state``; under ZeRO-1 those are the fp32 slices this rank
    owns, not the model's parameters.
    """

    def __init__(self, model: nn.Module, cls: type, *, clip_grad_norm: float | None = None,
                 nonfinite: str | None = None, check_replicas: int = CHECK_EVERY,
                 param_groups=None, **kwargs: Any) -> None:
        if nonfinite not in _NONFINITE:
            raise ConfigError(f"optimizer(nonfinite={nonfinite!r}): use one of "
                              f"{sorted(k for k in _NONFINITE if k)} (or leave it out)")
        # Optimizer.__init__ would build param_groups of its own: this one shares inner's.
        # OrderedDicts, as torch's: a hook's RemovableHandle holds its dict by weak reference.
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self.model, self.rt = model, runtime_of(model)
        self.clip, self.nonfinite = clip_grad_norm, nonfinite
        self.check_replicas = check_int(check_replicas, "optimizer", "check_replicas", low=0,
                                        example=CHECK_EVERY)
        self._agreed = False            # ``step`` agreed on this step's hyper-parameters
        seen: set[int] = set()
        self.params: list[tuple[str, nn.Parameter]] = []
        for n, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append((n, p))
        prec = self.rt.part(PrecisionPart)
        self.scaler = prec.scaler() if prec is not None else None
        self._group_of, options = group_layout(self.params, param_groups)
        tensors = self._inner_params(cls, kwargs)
        _refuse_on_dtensors(cls, [p for _, p in self.params])
        self.inner = None
        for part in self.rt.parts:          # offload splits it between host and device
            made = part.make_optimizer(self, cls, kwargs, tensors)
            if made is not None and len(options) > 1:
                raise ConfigError(f"optimizer(param_groups=...): {type(part).__name__} builds "
                                  f"its own optimizer over one group; give one group (set a "
                                  f"group's options after with opt.param_groups[i][...]) or "
                                  f"leave that transform out")
            self.inner = made or self.inner
        if self.inner is None:
            self.inner = cls(tensors if len(options) == 1 else
                             torch_groups(tensors, self._group_of, options,
                                          [bt for part in self.rt.parts
                                           for bt in part.stepped()]), **kwargs)
        mark_mesh_optimizer(self.inner)
        self.defaults = self.inner.defaults
        self.last_grad_norm: float | None = None
        self.steps = 0                  # step() calls, skipped ones included
        self.skipped_steps = 0          # steps skipped for a non-finite gradient norm
        self._synced = False

    def _inner_params(self, cls: type, kwargs: dict) -> list:
        inner, owner = None, None
        several = len(set(self._group_of.values())) > 1
        for part in self.rt.parts:
            # Several groups: a part that steps slices of its own keeps them apart.
            got = (part.optimizer_params(self.params, group_of=self._group_of) if several
                   else part.optimizer_params(self.params))
            if got is not None:
                inner, owner = got, part
        if inner is not None:
            _refuse_on_slices(cls, owner)
            return inner
        from torch.distributed.tensor import DTensor

        inner = [p for _, p in self.params]
        kinds = {isinstance(p, DTensor) for p in inner}
        if len(kinds) > 1 and "foreach" in _params_of(cls) and "foreach" not in kwargs:
            # torch's multi-tensor kernels group by device and dtype, not by tensor
            # type: DTensor and plain parameters in one list fail on CUDA.
            kwargs["foreach"] = False
        return inner

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigError("meshlab.optimizer covers every trainable parameter of the model "
                          "already; set per-group options with param_groups[i]['lr'] etc.")

    def __repr__(self) -> str:
        return f"MeshOptimizer({self.inner!r})"

    def __getstate__(self):
        raise ConfigError("a MeshOptimizer holds process groups and cannot be pickled; save "
                          "it with meshlab.checkpoint.save(..., optimizer=opt)")

    # -- a part's own view of the parameters (ZeRO-1's slices), through ``Part.stepped`` --
    @property
    def zero1(self):
        """The part whose tensors the inner optimizer steps in place of the parameters
        (ZeRO-1 over more than one data rank), or None."""
        return next((part for part in self.rt.parts if part.stepped()), None)

    @property
    def buckets(self) -> list:
        """The buckets of parameters behind ``shards``, in the same order."""
        return [b for part in self.rt.parts for b, _ in part.stepped()]

    @property
    def shards(self) -> list:
        """The tensors the inner optimizer steps in place of parameters (ZeRO-1's fp32
        slices); empty where it steps the parameters themselves."""
        return [t for part in self.rt.parts for _, t in part.stepped()]

    def refresh_master(self) -> None:
        """Copy the parameters into this rank's fp32 master copies (after a load)."""
        for part in self.rt.parts:
            part.refresh_master()

    def tensor_of(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor the inner optimizer updates for parameter ``p`` (its key in
        ``state``): ``p``, or offload's host master of it."""
        for part in self.rt.parts:
            p = part.tensor_of(p)
        return p

    # -- the step -------------------------------------------------------------------
    @contextlib.contextmanager
    def agreed_by_caller(self):
        """Inside, ``step()`` skips its agreement on the hyper-parameters: the caller
        (``meshlab.step``) made them part of its own."""
        self._agreed = True
        try:
            yield self
        finally:
            self._agreed = False

    def _sync_grads(self) -> None:
        """What the backward could not do (ZeRO-1's reduce-scatter; once per step)."""
        if self._synced:
            return
        self._synced = True
        for part in self.rt.sync_parts:
            part.sync_grads(self.params)

    def _grad_items(self) -> list[tuple[torch.Tensor, tuple]]:
        """(local gradient, groups it is sharded over) for the norm and overflow checks."""
        items = [(_local(p.grad), shard_groups(p.grad)) for _, p in self.params
                 if p.grad is not None]
        for part in self.rt.parts:
            items = part.grad_items(items)
        return items

    def grad_norm(self) -> float:
        """The global L2 norm of all gradients, over every mesh axis."""
        return float(self._global_norm(self._grad_items()))

    def _global_norm(self, items: list) -> torch.Tensor:
        """The global L2 norm of ``items``' gradients as a float32 scalar tensor, read by
        no one here: ``get_total_norm`` per group of gradients split alike (fp32 results,
        no copies), each group's square summed over the groups it is split over, then
        over each part's ``norm_groups`` (pipeline stages hold other parameters)."""
        alike: dict[tuple, tuple] = {}
        for g, groups in items:
            alike.setdefault(tuple(id(x) for x in groups), (groups, []))[1].append(g.detach())
        total = torch.zeros((), dtype=torch.float32, device=self.rt.device)
        for groups, grads in alike.values():
            s = _norm32(grads).square()
            for grp in groups:
                dist.all_reduce(s, group=grp)
            total += s.to(total.device)
        for part in self.rt.parts:
            for grp in part.norm_groups():
                dist.all_reduce(total, group=grp)
        return total.sqrt()

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """ZeRO-1's reduce-scatter, unscale, check overflow, clip, update, all-gather.
        Returns False if the step was skipped (an fp16 overflow, or a non-finite gradient
        norm under ``nonfinite='skip'``)."""
        if closure is not None:
            raise ConfigError("meshlab.optimizer's step takes no closure (optimizers that "
                              "re-evaluate the loss, such as LBFGS, are not supported)")
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if not self._agreed:        # before the step's first collective (ZeRO-1's)
            agree_hyperparameters(self.rt.ctrl_group, "meshlab.optimizer step", self.inner)
        self.steps += 1
        self._sync_grads()
        # Read only when needed: offloaded gradients are then waited for on the host.
        items = self._grad_items() if self.scaler is not None or self.clip is not None or \
            self.nonfinite is not None else []
        if self.scaler is not None and not self._unscale(items):
            return False
        if self.clip is not None or self.nonfinite is not None:
            norm_t = self._global_norm(items)
            norm = float(norm_t)        # the step's one read of the norm (two under fp16)
            self.last_grad_norm = norm
            if not math.isfinite(norm):
                return self._nonfinite(norm)
            if self.clip is not None:
                self._clip(items, norm_t)
        self.inner.step()
        for part in self.rt.parts:
            part.after_step()
        self._synced = False
        if self.check_replicas and self.steps % self.check_replicas == 0:
            _check_replicas(self.model, self.rt.ctrl_group,
                            f"meshlab.optimizer step {self.steps}: the replicas' check")
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return True

    def _nonfinite(self, norm: float) -> bool:
        """A NaN or infinite global norm: every rank computed the same value (it is reduced
        over every axis the gradients are split over, and replicated gradients are equal
        after the backward's reduction), so every rank skips, or raises, alike. The
        gradients are dropped either way, leaving the optimizer ready for the next step."""
        self.zero_grad()
        self.skipped_steps += 1
        what = (f"step {self.steps}: the global gradient norm is {norm} (a NaN or infinity in "
                f"some rank's loss or gradients, spread to every rank by the reduction)")
        if self.nonfinite == "raise":
            raise NonFiniteError(f"meshlab.optimizer {what}; the step did not run. Look for the "
                                 f"batch or operation that overflows, lower the learning rate, "
                                 f"or pass nonfinite='skip' to skip such steps")
        warnings.warn(f"meshlab.optimizer {what}: the step was skipped on every rank and the "
                      f"weights are unchanged ({self.skipped_steps} skipped so far); pass "
                      f"nonfinite='raise' to stop instead", RuntimeWarning, stacklevel=3)
        return False

    def _clip(self, items: list, norm: torch.Tensor) -> None:
        """Multiply the gradients by ``min(clip / (norm + 1e-6), 1)``, computed where the
        norm lies and read by no one (no host sync)."""
        clip_grads_with_norm_([_Holder(g) for g, _ in items], self.clip, norm)

    def _unscale(self, items: list) -> bool:
        """Divide the gradients by the loss scale and agree on an overflow (the scaler's
        fused kernel, one all-reduce, one read); an overflowing step drops them."""
        overflow = self.scaler.unscale_([g for g, _ in items], self.rt.device)
        self.scaler.update(overflow)
        if overflow:
            self.zero_grad()
        return not overflow

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._synced = False
        for _, p in self.params:
            p.grad = None
        for s in self.shards:
            s.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The inner optimizer's ``state_dict`` (plus ``grad_scaler`` under fp16)."""
        d = self.inner.state_dict()
        if self.scaler is not None:
            d["grad_scaler"] = self.scaler.state_dict()
        return d

    def load_state_dict(self, d: Mapping) -> None:
        d = dict(d)
        scaler = d.pop("grad_scaler", None)
        self.inner.load_state_dict(d)
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)


def optimizer(model: nn.Module, cls: type = torch.optim.AdamW, *,
              clip_grad_norm: float | None = None, nonfinite: str | None = None,
              check_replicas: int = CHECK_EVERY, param_groups=None,
              **kwargs: Any) -> MeshOptimizer:
    """An optimizer over a parallelized model's parameters (``cls(**kwargs)`` inside).

    ``clip_grad_norm`` clips by the global norm over all mesh axes. ZeRO-1 keeps the
    optimizer state for this rank's slice only.

    ``param_groups`` takes torch's groups, ``[{'params': [...], **options}]``, each
    parameter of the parallelized model named by itself or its FQN; a group's options
    override ``kwargs`` for its parameters (fine-tuning's no-weight-decay group of biases
    and norms). Every trainable parameter is in exactly one group.

    ``nonfinite`` says what a step whose global gradient norm is NaN or infinite does (a
    NaN on one rank reaches every rank through the gradient reduction, and one update
    would turn every weight NaN): ``'skip'`` skips it on every rank, weights and optimizer
    state unchanged, and warns with the step and the norm (``step()`` returns False);
    ``'raise'`` raises ``NonFiniteError`` on every rank. The check reads the global norm:
    with ``clip_grad_norm`` it is computed anyway, and a non-finite one is skipped unless
    ``nonfinite='raise'``. Without clipping the norm costs one all-reduce per group of
    gradients split alike (none for replicated ones), so it runs only when ``nonfinite`` is
    given. Under ``precision('fp16')`` the loss scaler skips overflowing steps first.

    Every step agrees on the hyper-parameters of every group across the ranks (one small
    exchange, folded into ``meshlab.step``'s own), and every ``check_replicas`` steps
    (default 50; 0: never) each parameter's shard is compared with the other ranks that
    hold it: replicas that drifted apart raise ``RankMismatchError`` on every rank, naming
    the first parameter that differs and the ranks.

    >>> opt = optimizer(model, torch.optim.AdamW, lr=3e-4, clip_grad_norm=1.0)  # doctest: +SKIP
    """
    from ..core.errors import check_number

    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise ConfigError(f"optimizer(model, cls, ...): cls must be an optimizer class such as "
                          f"torch.optim.AdamW, got {cls!r}")
    if clip_grad_norm is not None:
        check_number(clip_grad_norm, "optimizer", "clip_grad_norm", example=1.0)
    return MeshOptimizer(model, cls, clip_grad_norm=clip_grad_norm, nonfinite=nonfinite,
                         check_replicas=check_replicas, param_groups=param_groups, **kwargs)
