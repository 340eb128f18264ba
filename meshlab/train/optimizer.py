"""``optimizer``: a torch optimizer with what only the whole mesh can add.

Gradients are synchronized by the backward itself (each room's ``Reduction``, run by
``GradSync``), so a plain ``torch.optim.AdamW(model.parameters())`` trains a
parallelized model correctly. ``meshlab.optimizer`` adds, in ``step()``: ZeRO-1's
reduce-scatter into fp32 slices and all-gather back (``Part.sync_grads`` /
``after_step``), unscaling and the overflow check agreed by every rank (fp16 loss
scaling), gradient-norm clipping over every mesh axis, and the skip of a step whose
global gradient norm is NaN or infinite (``nonfinite``).

Optimizers that are not elementwise (LAMB, Adafactor, Muon, ...) step whole tensors where
meshlab would give them pieces: under ZeRO-1 each parameter is owned by one data rank
(``transforms/zero/_owned.py``), and on DTensor parameters those DTensor cannot compute
(``WHOLE_ON_DTENSORS``: Adafactor) are stepped as whole plain tensors, each on one rank of
its mesh (``_whole.py``). It is a
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
from ._state_moves import fit_to, placed, portable
from ._whole import WholeTensors
from ._content import CHECK_EVERY, agree_hyperparameters, check_replicas as _check_replicas
# which optimizers take slices and which are stepped whole (public names re-exported here,
# where the docs name them)
from ._kinds import (ELEMENTWISE as ELEMENTWISE, WHOLE_ON_DTENSORS as WHOLE_ON_DTENSORS,
                     elementwise as elementwise, register_elementwise as register_elementwise,
                     _refuse_on_dtensors, _refuse_on_slices, _whole_on_dtensors)


_NONFINITE = (None, "skip", "raise")


def _params_of(fn) -> set[str]:
    """The parameter names of a class's ``__init__``, or of a function."""
    try:
        return set(inspect.signature(fn.__init__ if isinstance(fn, type) else fn).parameters)
    except (TypeError, ValueError):
        return set()


class _Holder:
    """A gradient where ``clip_grads_with_norm_`` looks for one (``.grad``): the tensors
    clipped are the local gradients the parts hand over (ZeRO-1's slices, offload's host
    copies), not parameters' ``.grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def _norm(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The L2 norm of ``grads`` as one scalar of ``dtype`` (float32 or wider):
    ``get_total_norm`` over fp32 (and wider) ones, and fp16/bf16 ones through per-tensor
    norms accumulated in float32 (``get_total_norm`` would round each to its dtype)."""
    wide = [g for g in grads if g.dtype.itemsize >= 4]
    parts = [get_total_norm(wide).to(dtype)] if wide else []
    narrow: dict = {}
    for g in grads:
        if g.dtype.itemsize < 4:
            narrow.setdefault(g.device, []).append(g)
    for gs in narrow.values():
        parts += [n.to(dtype) for n in torch._foreach_norm(gs, 2.0, dtype=torch.float32)]
    return parts[0] if len(parts) == 1 else get_total_norm(parts)


class MeshOptimizer(torch.optim.Optimizer):
    """A torch optimizer driven the way a parallelized model needs (see module doc).

    It holds the optimizer it was built with as ``inner`` and shares its
    ``param_groups`` and ``state``; under ZeRO-1 those are the fp32 slices this rank
    owns (or the fp32 masters of the whole parameters it owns, for an optimizer that is
    not elementwise), and for DTensors stepped whole the stand-ins this rank owns, not the
    model's parameters.
    """

    def __init__(self, model: nn.Module, cls: type, *, clip_grad_norm: float | None = None,
                 nonfinite: str | None = None, check_replicas: int = CHECK_EVERY,
                 param_groups=None, zero1_whole: bool = False, **kwargs: Any) -> None:
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
        from ..core.errors import check_bool

        self.zero1_whole = check_bool(zero1_whole, "optimizer", "zero1_whole")
        self.check_replicas = check_int(check_replicas, "optimizer", "check_replicas", low=0,
                                        example=CHECK_EVERY)
        self._agreed = False            # ``step`` agreed on this step's hyper-parameters
        seen: set[int] = set()
        self.params: list[tuple[str, nn.Parameter]] = []
        for n, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append((n, p))
        self._held_ids = frozenset(seen)
        prec = self.rt.part(PrecisionPart)
        self.scaler = prec.scaler() if prec is not None else None
        self._scaled = False        # a backward of this step ran on the scaled loss
        held = {n for n, _ in model.named_parameters()}
        elsewhere = frozenset(e.fqn for e in self.rt.plan.params) - held \
            if self.rt.roles.pp is not None else frozenset()
        self._group_of, options = group_layout(self.params, param_groups, elsewhere)
        self._options = options
        tensors = self._inner_params(cls, kwargs)
        _refuse_on_dtensors(cls, [p for _, p in self.params])
        self.inner = None
        for part in self.rt.parts:          # offload splits it between host and device
            made = part.make_optimizer(self, cls, kwargs, tensors)
            if made is not None and len(made.param_groups) != len(options):
                raise ConfigError(f"optimizer(param_groups=...): {type(part).__name__} builds "
                                  f"its own optimizer over one group; give one group (set a "
                                  f"group's options after with opt.param_groups[i][...]) or "
                                  f"leave that transform out")
            if made is not None and self.zero1_whole:
                raise ConfigError(f"optimizer(zero1_whole=True) beside {type(part).__name__}, "
                                  f"which builds its own optimizer over ZeRO-1's flat slices: "
                                  f"not yet; leave zero1_whole out, or that transform")
            if made is not None and _whole_on_dtensors(cls, tensors):
                raise ConfigError(f"optimizer {cls.__name__} on DTensor parameters beside "
                                  f"{type(part).__name__}, which builds its own optimizer: "
                                  f"{cls.__name__} steps whole tensors gathered on an owner, "
                                  f"which that optimizer does not; use an elementwise "
                                  f"optimizer, or leave that transform out")
            self.inner = made or self.inner
        # DTensors the optimizer cannot step: whole plain stand-ins on their owners.
        self._whole = WholeTensors(tensors) if self.inner is None and \
            _whole_on_dtensors(cls, tensors) else None
        if self.inner is None:
            groups = [{"params": tensors}] if len(options) == 1 else self.torch_groups(tensors)
            if self._whole is not None:
                groups = [{**g, "params": self._whole.replace(g["params"])} for g in groups]
            self.inner = cls(groups, **kwargs)
        mark_mesh_optimizer(self.inner)
        self.defaults = self.inner.defaults
        self.last_grad_norm: float | None = None
        self.steps = 0                  # step() calls, skipped ones included
        self.skipped_steps = 0          # steps skipped for a non-finite gradient norm
        self._synced = False

    def torch_groups(self, tensors: list, stand_in: dict | None = None) -> list[dict]:
        """``tensors`` (what the inner optimizer steps: parameters, ZeRO-1's slices, or
        tensors standing for parameters, ``stand_in`` mapping their ids to those, as
        offload's host masters do) split into the ``param_groups`` the user gave, with each
        group's options."""
        group_of = self._group_of
        if stand_in:
            group_of = {**group_of, **{i: group_of[id(p)] for i, p in stand_in.items()}}
        return torch_groups(tensors, group_of, self._options,
                            [bt for part in self.rt.parts for bt in part.stepped()])

    def _inner_params(self, cls: type, kwargs: dict) -> list:
        inner, owner = None, None
        several = len(set(self._group_of.values())) > 1
        for part in self.rt.parts:
            # Several groups: a part that steps slices of its own keeps them apart. An
            # optimizer that reduces over tensors asks for whole ones (ZeRO-1's owners).
            kw = {"group_of": self._group_of} if several else {}
            if (not elementwise(cls) or self.zero1_whole) and \
                    "whole" in _params_of(type(part).optimizer_params):
                kw["whole"] = True      # (a part that slices without asking is refused below)
            got = part.optimizer_params(self.params, **kw)
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
        return next((part for part in self.rt.parts
                     if part.stepped() or getattr(part, "whole", False)), None)

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
        if self._whole is not None:
            self._whole.refresh()

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

    def _check_trainable(self) -> None:
        """Refuses a parameter made trainable after this optimizer was built (torch's
        optimizer over ``model.parameters()`` would train it once unfrozen; this one holds
        the parameters trainable when it was built, and would leave it as it is)."""
        late = [n for n, p in self.model.named_parameters()
                if p.requires_grad and id(p) not in self._held_ids]
        if late:
            raise ConfigError(
                f"meshlab.optimizer step: {late[:3]}{'...' if len(late) > 3 else ''} "
                f"became trainable after the optimizer was built (or were replaced, "
                f"e.g. by load_state_dict(assign=True)), and it holds the parameters "
                f"trainable then; set requires_grad before parallelize (or boost) and "
                f"build the optimizer after it")

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
        """The global L2 norm of ``items``' gradients as a scalar tensor, read by no one
        here: ``get_total_norm`` per group of gradients split alike (no copies), each
        group's square summed over the groups it is split over, then over each part's
        ``norm_groups`` (pipeline stages hold other parameters, perhaps of other dtypes:
        that sum is float64). float32, float64 where a gradient is float64 (in float32 a
        float64 model's clipping was off one process's ``clip_grad_norm_`` by about 1e-10
        relative); the ranks of a group hold parameters of the same dtypes."""
        alike: dict[tuple, tuple] = {}
        for g, groups in items:
            alike.setdefault(tuple(id(x) for x in groups), (groups, []))[1].append(g.detach())
        wide = any(g.dtype == torch.float64 for g, _ in items)
        dtype = torch.float64 if wide else torch.float32
        total = torch.zeros((), dtype=dtype, device=self.rt.device)
        for groups, grads in alike.values():
            s = _norm(grads, dtype).square()
            for grp in groups:
                dist.all_reduce(s, group=grp)
            total += s.to(total.device)
        stages = [grp for part in self.rt.parts for grp in part.norm_groups()]
        if stages:
            total = total.double()
        for grp in stages:
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
        self._check_trainable()
        if self.scaler is not None and not self._scaled:
            raise ConfigError(
                "meshlab.optimizer step under precision('fp16'): no backward of this step ran "
                "on the scaled loss, and the step divides the gradients by the loss scale "
                f"({self.scaler.scale:g}), which would shrink the update as much. In a loop "
                "of your own call opt.scale(loss).backward() (as torch's GradScaler.scale), "
                "or use ml.step / booster.backward(loss, optimizer)")
        self._scaled = False
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
        if self._whole is not None:
            self._whole.before_step()
        self.inner.step()
        if self._whole is not None:
            self._whole.after_step()
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

    def loss_scale(self) -> float:
        """What this step's loss is multiplied by before its backward: the fp16 loss
        scale (1.0 without fp16). ``step``, the Booster and a pipeline's schedule read it
        here, which notes that the gradients the step will divide by it are scaled."""
        self._scaled = True
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, as ``torch.amp.GradScaler.scale``: under
        ``precision('fp16')`` a loop of your own runs ``opt.scale(loss).backward()`` before
        ``opt.step()``, which divides the gradients by it (the loss itself without fp16)."""
        return loss * self.loss_scale() if self.scaler is not None else loss

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
        """The inner optimizer's ``state_dict`` (plus ``grad_scaler`` under fp16).

        Where each parameter is stepped whole by one owner (ZeRO-1 with an optimizer that is
        not elementwise, ``WHOLE_ON_DTENSORS`` on DTensors), it is torch's layout over the
        model's parameters (in ``named_parameters`` order within each group), each
        parameter's state gathered from its owner onto the host: a collective, every rank
        calls it and gets the same dict."""
        d = self._state_by_owner() if self._by_owner() else self.inner.state_dict()
        if self.scaler is not None:
            d["grad_scaler"] = self.scaler.state_dict()
        return d

    def load_state_dict(self, d: Mapping) -> None:
        """The inverse of ``state_dict``: where parameters are stepped by their owners,
        each rank keeps the state of those it owns (no collective)."""
        d = dict(d)
        scaler = d.pop("grad_scaler", None)
        self.inner.load_state_dict(self._inner_layout(d) if self._by_owner() else d)
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)

    # -- whole tensors stepped by owners (ZeRO-1's, DTensors' stand-ins) ----------------
    @property
    def _owned_part(self):
        """The part whose owners step whole parameters (ZeRO-1 with an optimizer that is
        not elementwise), or None."""
        return next((part for part in self.rt.parts if getattr(part, "whole", False)), None)

    def _by_owner(self) -> bool:
        return self._whole is not None or self._owned_part is not None

    def check_checkpointable(self, where: str) -> None:
        """``meshlab.checkpoint`` names optimizer state by each rank's tensors; where
        owners step whole tensors it is refused (``state_dict()`` serves instead)."""
        if self._by_owner():
            how = "zero_shard(1) steps each parameter whole on one data rank" \
                if self._owned_part is not None else \
                f"{type(self.inner).__name__} steps each DTensor whole on one rank of its mesh"
            raise ConfigError(f"{where}: the optimizer state of {type(self.inner).__name__} "
                              f"lives with the owners of the parameters ({how}), which "
                              f"meshlab.checkpoint does not save or load yet; save the model "
                              f"without it (optimizer=None) and keep opt.state_dict() (torch's "
                              f"layout, gathered from the owners) with torch.save, or use an "
                              f"elementwise optimizer")

    def _holder(self, p):
        """The tensor the inner optimizer steps for parameter ``p`` on this rank (ZeRO-1's
        master, a DTensor's stand-in, ``p``), or None where another rank owns it."""
        z = self._owned_part
        t = z.buffers.master.get(id(p)) if z is not None else p
        if t is None or self._whole is None:
            return t
        return self._whole.holder(t)

    def _torch_order(self) -> list[list]:
        """The model's parameters by inner group, as one process's optimizer numbers them."""
        kept = sorted(set(self._group_of.values()))
        order: list[list] = [[] for _ in kept]
        for _, p in self.params:
            order[kept.index(self._group_of[id(p)])].append(p)
        return order

    def _state_by_owner(self) -> dict:
        z, out, groups, i = self._owned_part, {}, [], 0
        for g, ps in zip(self.inner.param_groups, self._torch_order()):
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(i, i + len(ps)))})
            for p in ps:
                t = z.buffers.master.get(id(p)) if z is not None else p
                st = None
                if t is not None:       # this rank's data rank owns it (or no ZeRO-1)
                    h = self._whole.holder(t) if self._whole is not None else t
                    st = portable(self.inner.state.get(h)) if h is not None else None
                    if self._whole is not None:
                        st = self._whole.share(t, st)
                if z is not None:
                    st = z.buffers.share(p, st)
                if st:
                    out[i] = placed(p, st)
                i += 1
        return {"state": out, "param_groups": groups}

    def _inner_layout(self, d: dict) -> dict:
        """A ``state_dict`` in torch's layout over the model's parameters as the inner
        optimizer's own: the state of the tensors this rank steps."""
        order = self._torch_order()
        saved = list(d.get("param_groups", []))
        if len(saved) != len(order) or any(len(g["params"]) != len(ps)
                                           for g, ps in zip(saved, order)):
            raise ConfigError(f"{self!r}.load_state_dict: the dict's groups hold "
                              f"{[len(g['params']) for g in saved]} parameters, this "
                              f"optimizer's {[len(ps) for ps in order]}; load a state_dict of "
                              f"an optimizer over the same parameters and groups")
        index: dict[int, int] = {}
        groups = []
        for g, sg in zip(self.inner.param_groups, saved):
            ids = []
            for t in g["params"]:
                index[id(t)] = len(index)
                ids.append(index[id(t)])
            groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": ids})
        state, states = {}, d.get("state", {})
        for sg, ps in zip(saved, order):
            for k, p in zip(sg["params"], ps):
                h = self._holder(p)
                st = states.get(k)
                if h is not None and st:
                    state[index[id(h)]] = {key: fit_to(h, v) for key, v in st.items()}
        return {"state": state, "param_groups": groups}


def optimizer(model: nn.Module, cls: type = torch.optim.AdamW, *,
              clip_grad_norm: float | None = None, nonfinite: str | None = None,
              check_replicas: int = CHECK_EVERY, param_groups=None,
              zero1_whole: bool = False, **kwargs: Any) -> MeshOptimizer:
    """An optimizer over a parallelized model's parameters (``cls(**kwargs)`` inside).

    ``clip_grad_norm`` clips by the global norm over all mesh axes. ZeRO-1 keeps the
    optimizer state for this rank's slice only (an elementwise optimizer), or for the
    whole parameters this rank owns (any other: ``opt.zero1.owners``).

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

    ``zero1_whole=True``: under ``zero_shard(1)`` an elementwise optimizer steps whole
    parameters, each on one data rank (``opt.zero1.owners``), as any other optimizer does,
    instead of flat slices of several. A parameter that no data rank has a gradient for in
    a step (a branch or expert no sample used) is then left alone, as one process's
    optimizer leaves it; on flat slices such a step is refused by name. The state balances
    by whole tensors, and ``meshlab.checkpoint`` does not save it yet (``state_dict()``
    does).

    >>> opt = optimizer(model, torch.optim.AdamW, lr=3e-4, clip_grad_norm=1.0)  # doctest: +SKIP
    """
    from ..core.errors import check_number

    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise ConfigError(f"optimizer(model, cls, ...): cls must be an optimizer class such as "
                          f"torch.optim.AdamW, got {cls!r}")
    if clip_grad_norm is not None:
        check_number(clip_grad_norm, "optimizer", "clip_grad_norm", example=1.0)
    return MeshOptimizer(model, cls, clip_grad_norm=clip_grad_norm, nonfinite=nonfinite,
                         check_replicas=check_replicas, param_groups=param_groups,
                         zero1_whole=zero1_whole, **kwargs)
