"""AdamW whose step is one kernel launch per (device, dtype) group of parameters.

:class:`FusedAdamW` is a drop-in for ``torch.optim.AdamW`` (same arguments and defaults,
same state layout, the arithmetic in its order), for the cases ``torch.optim.AdamW(fused=True)``
covers:
parameter, gradient and state of one dtype (float32, bfloat16 or float16), math in float32,
no ``amsgrad``, no ``maximize``. Where each parameter's tensors live decides what runs:

* CUDA: the Triton kernel of ``_triton_adamw.py``. One launch per (device, dtype, step)
  group updates every tensor of the group, each element read once (param, grad, exp_avg,
  exp_avg_sq) and written once (param, exp_avg, exp_avg_sq): the floor for a
  bandwidth-bound update.
* CPU, float32: the OpenMP loop of ``csrc/cpu_adam.cpp``, called as :class:`CPUAdamW`
  calls it.
* Anything else (another device or dtype, tensors that are not contiguous, native kernels
  switched off by ``MESHLAB_OPS_NATIVE=0`` or ``_build.force_reference()``, Triton or the
  C++ extension missing): :func:`~meshlab.ops.cpu_adam.adamw_reference`, the same update
  in separate PyTorch ops. ``native`` is then False and ``fallback_reason`` says why;
  ``_build.LAST_PATH[("fused_adamw", device)]`` records the path of the last step on each
  device type.

Design: one launch covers all tensors of a (device, dtype, step count) group, whatever
their number and sizes; its programs find their tensors through a table of raw addresses
rather than through flat per-group buffers. A flat buffer would need parameters, gradients
and state copied in and out every step, or allocated inside it from the start, which ties
the optimizer to how the model and autograd allocate them; the table updates the tensors
where they are. It is built once and cached on the device, keyed by the addresses of
parameters and state (which do not move between steps); gradients, which
``zero_grad(set_to_none=True)`` lets the next backward allocate anywhere, have their own
address column, uploaded again (8 bytes per tensor, one non-blocking copy from pinned
memory) only when an address changed. A step whose set of parameters with gradients
differs from the last one's builds the tables again.

Step counts: ``state["step"]`` is a float32 CPU scalar tensor, as in ``torch.optim.AdamW``'s
default (non-fused, non-capturable) mode, so the bias corrections are computed on the host
and no step reads from the device. The step tensors of the parameters stepped together are
0-d views of one float32 buffer: one ``add_`` counts a step for all of them, where a
separate tensor per parameter costs about a microsecond each to increment. They save,
load and print as any step tensor; step tensors from elsewhere (a loaded state dict, or set
by hand) are copied into a new buffer at the next step, whose views then replace them. The
host work per step is a few attribute reads per parameter, to check that the cached tables
still describe the parameters; the step is not capturable in a CUDA graph.

State dicts move between ``FusedAdamW`` and ``torch.optim.AdamW`` in both directions: the
state holds ``step``, ``exp_avg`` and ``exp_avg_sq`` (created with ``zeros_like(param)``,
so DTensors for DTensor parameters), and the param groups carry ``torch.optim.AdamW``'s keys.
``foreach``, ``fused`` and ``capturable`` are kept for that reason only; a step tensor loaded
from a fused or capturable checkpoint (on the device) is moved to the CPU.

DTensor parameters are updated through ``to_local()`` of parameter, gradient and state:
AdamW is elementwise, so each rank updates its own shards. Their gradients must have the
parameter's placements.

>>> import torch
>>> from meshlab.ops import FusedAdamW
>>> w = torch.nn.Parameter(torch.ones(4))
>>> opt = FusedAdamW([w], lr=0.1)
>>> w.sum().backward(); opt.step()
>>> w.detach()
tensor([0.8990, 0.8990, 0.8990, 0.8990])
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.errors import ConfigError
from . import _build
from .cpu_adam import adamw_reference, cpu_adam_kernels
from ..core.tensors import local as _local

OP = "fused_adamw"
_TRITON_PATH = "Triton kernel (meshlab/ops/_triton_adamw.py)"
_CPP_PATH = "C++ kernel (csrc/cpu_adam.cpp)"
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Which kernel updates the tensors of each device type; other devices run the reference.
# Mapping "cpu" to "triton" runs the Triton path on CPU tensors under TRITON_INTERPRET=1,
# which is how that path is exercised without a GPU.
KERNEL_FOR_DEVICE = {"cuda": "triton", "cpu": "cpp"}

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_STATE_ITEMS = operator.itemgetter("exp_avg", "exp_avg_sq", "step")
_data_ptr = Tensor.data_ptr
_is_contiguous = Tensor.is_contiguous

_TRITON: object | None = None
_TRITON_WHY: str | None = None


def triton_adamw():
    """The ``_triton_adamw`` module, or ``None`` when Triton cannot be imported (see
    :func:`triton_unavailable_reason`). Imported on the first CUDA step, never before."""
    global _TRITON, _TRITON_WHY
    if _TRITON is None and _TRITON_WHY is None:
        try:
            from . import _triton_adamw
            _TRITON = _triton_adamw
        except ImportError as e:
            _TRITON_WHY = f"triton unavailable: {e}"
    return _TRITON


def triton_unavailable_reason() -> str | None:
    """Why :func:`triton_adamw` returned ``None``, or ``None`` if it did not (yet)."""
    return _TRITON_WHY


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:            # torch built without distributed
        return None
    return DTensor


def _check_group_options(group: dict) -> None:
    if group.get("amsgrad", False):
        raise ConfigError("FusedAdamW does not implement amsgrad=True; use "
                          "torch.optim.AdamW(amsgrad=True, fused=True) for those parameters")
    if group.get("maximize", False):
        raise ConfigError("FusedAdamW does not implement maximize=True; negate the loss, or "
                          "use torch.optim.AdamW(maximize=True)")
    if group.get("differentiable", False):
        raise ConfigError("FusedAdamW's step is not differentiable; use "
                          "torch.optim.AdamW(differentiable=True)")


@dataclass(eq=False)
class _Tables:
    """Device copies of one launch's tables (see ``_triton_adamw``) and what they hold."""

    tensors: Tensor                       # (n, 4) int64: param, exp_avg, exp_avg_sq, numel
    chunks: Tensor                        # (c, 2) int32: tensor index, chunk index
    state_aligned: bool                   # every param/state address a multiple of 16
    stream: object = None                 # the CUDA stream the tables were last used on
    grads: Tensor | None = None           # (n,) int64 gradient addresses
    grad_ptrs: list[int] = field(default_factory=list)
    grads_aligned: bool = False


@dataclass(eq=False)
class _Bucket:
    """Parameters of one plan that share a device and dtype, and whether a kernel can take
    their parameter and state tensors (``why`` is ``None``) or why not."""

    device: torch.device
    dtype: torch.dtype
    members: list[int]
    why: str | None
    tables: dict[tuple[int, ...] | None, _Tables] = field(default_factory=dict)


@dataclass(eq=False)
class _Plan:
    """What one param group's step needs besides the gradients, valid while the group's
    parameters with gradients, their state and the addresses of both stay the same."""

    params: list[Tensor]                  # parameters with a gradient, in group order
    states: list[dict]                    # their state dicts
    items: list[Tensor]                   # exp_avg, exp_avg_sq, step of each, flattened
    steps: Tensor                         # float32 CPU; params[i]'s state["step"] is steps[i]
    local_p: list[Tensor]                 # local tensors (to_local() for DTensors)
    local_m: list[Tensor]
    local_v: list[Tensor]
    ptrs: list[int]                       # addresses of local_p + local_m + local_v
    dtensor: bool
    buckets: list[_Bucket]


@dataclass(eq=False)
class _Route:
    """One step of one bucket: the parameters a kernel updates (indices into the plan, with
    their gradients) and those the reference updates, with the reason."""

    bucket: _Bucket
    kernel: object | None                 # the _triton_adamw module or the C++ extension
    kind: str | None                      # "triton" or "cpp"
    members: list[int]
    grads: list[Tensor]
    whole: bool                           # members is the whole plan, in order
    reference: list[int]
    why: str                              # the kernel's name, or why the reference ran


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with one fused kernel launch per (device, dtype) group of parameters.

    Arguments are ``torch.optim.AdamW``'s: ``lr`` (1e-3, a float or a 1-element tensor,
    read on the host each step), ``betas`` ((0.9, 0.999)), ``eps`` (1e-8) and
    ``weight_decay`` (1e-2, decoupled: ``p *= 1 - lr * weight_decay``). ``amsgrad`` and
    ``maximize`` exist so that code passing them keeps working, and raise
    :class:`~meshlab.ConfigError` when true.

    After a step, ``native`` is True when every parameter ran a fused kernel (Triton on
    CUDA, C++ on the CPU); otherwise ``fallback_reason`` gives the first reason a parameter
    ran the reference. See the module docstring for the paths, the cached tables and the
    step-count layout.
    """

    def __init__(self, params, lr: float | Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False):
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ConfigError(f"FusedAdamW: a tensor lr must have one element, got shape "
                              f"{tuple(lr.shape)}")
        betas = tuple(float(b) for b in betas)
        if not (float(lr) >= 0 and eps >= 0 and weight_decay >= 0 and len(betas) == 2
                and all(0 <= b < 1 for b in betas)):
            raise ConfigError(f"FusedAdamW: need lr, eps, weight_decay >= 0 and two betas in "
                              f"[0, 1); got lr={float(lr)}, eps={eps}, "
                              f"weight_decay={weight_decay}, betas={betas}")
        # torch.optim.AdamW's keys and defaults, so that state dicts load into either.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=None, capturable=False,
                        differentiable=False, fused=None, decoupled_weight_decay=True)
        _check_group_options(defaults)
        self._plans: dict[int, _Plan] = {}
        super().__init__(params, defaults)
        self.native: bool | None = None
        self.fallback_reason: str | None = None

    def add_param_group(self, param_group: dict) -> None:
        _check_group_options(param_group)
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        # Optimizer.load_state_dict lands here too: whatever was cached is stale.
        super().__setstate__(state)
        self._plans = {}
        self.__dict__.setdefault("native", None)
        self.__dict__.setdefault("fallback_reason", None)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if key not in ("lr", "betas", "eps", "weight_decay"):
                    group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of ``FusedAdamW`` or ``torch.optim.AdamW`` (any mode).

        Raises :class:`~meshlab.ConfigError` before changing anything when the dict was
        saved with ``amsgrad``, ``maximize`` or ``differentiable``. Step counts saved on a
        device (``fused=True`` or ``capturable=True``) come back as CPU tensors.
        """
        for group in state_dict["param_groups"]:
            _check_group_options(group)
        super().load_state_dict(state_dict)
        for st in self.state.values():
            step = st.get("step")
            if step is not None and not (isinstance(step, Tensor) and step.device.type == "cpu"
                                         and step.dtype == torch.float32 and step.dim() == 0):
                st["step"] = torch.tensor(float(step), dtype=torch.float32)

    # ------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        off = _build.native_disabled_reason()
        native: dict[str, bool] = {}          # device type -> every bucket ran a kernel
        reasons: dict[str, str] = {}          # device type -> kernel, or first fallback reason
        for gi, group in enumerate(self.param_groups):
            _check_group_options(group)
            params = group["params"]
            grads = list(map(_GRAD, params))
            if not any(map(operator.is_, grads, itertools.repeat(None))):
                active = params
            else:
                active = [p for p, g in zip(params, grads) if g is not None]
                grads = [g for g in grads if g is not None]
            if not active:
                continue
            plan = self._plans.get(gi)
            if plan is None or not self._plan_valid(plan, active):
                plan = self._plans[gi] = self._make_plan(active)
            if plan.dtensor:
                grads = [_local_grad(p, g) for p, g in zip(active, grads)]
            # Route every bucket first: a gradient that cannot be stepped raises here,
            # before any step count or tensor changes.
            routes = [self._route(plan, b, grads, off) for b in plan.buckets]
            plan.steps.add_(1)
            step_values = plan.steps.tolist()
            lr = group["lr"]
            lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
            beta1, beta2 = (float(b) for b in group["betas"])
            hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]))
            for route in routes:
                self._run(plan, route, grads, step_values, hyper)
                dev = route.bucket.device.type
                if route.reference:
                    if native.get(dev, True):
                        reasons[dev] = route.why
                    native[dev] = False
                elif dev not in native:
                    native[dev] = True
                    reasons[dev] = route.why
        for gi in [i for i in self._plans if i >= len(self.param_groups)]:
            del self._plans[gi]                       # groups that are gone
        for dev, ok in native.items():
            _build.record(OP, dev, ok, reasons[dev])
        if native:
            self.native = all(native.values())
            self.fallback_reason = next((reasons[d] for d, ok in native.items() if not ok), None)
        return loss

    def _route(self, plan: _Plan, bucket: _Bucket, grads: list[Tensor], off: str | None
               ) -> _Route:
        """Which of the bucket's parameters a kernel takes this step, and which the
        reference; raises for gradients neither can take."""
        members = bucket.members
        whole = len(members) == len(plan.params)
        gs = grads if whole else [grads[i] for i in members]
        why = bucket.why or off
        kind = KERNEL_FOR_DEVICE.get(bucket.device.type)
        kernel = None
        if why is None:
            if kind == "triton":
                kernel = triton_adamw()
                why = None if kernel is not None else triton_unavailable_reason()
            else:
                kernel = cpu_adam_kernels()
                why = None if kernel is not None else (
                    _build.failure("meshlab_cpu_adam") or "C++ extension not built")
        if kernel is None:
            for g in gs:
                _check_grad(g, bucket.dtype)
            return _Route(bucket, None, kind, [], [], False, list(members), why)
        # Gradients change every step: check them each time, cheaply when all are fine.
        if all(map(_is_contiguous, gs)) and \
                all(map(operator.is_, map(_DTYPE, gs), itertools.repeat(bucket.dtype))):
            return _Route(bucket, kernel, kind, list(members), gs, whole, [],
                          _TRITON_PATH if kind == "triton" else _CPP_PATH)
        keep, ref = [], []
        for i, g in zip(members, gs):
            _check_grad(g, bucket.dtype)
            (keep if g.is_contiguous() else ref).append(i)
        return _Route(bucket, kernel, kind, keep, [grads[i] for i in keep], False, ref,
                      "gradient not contiguous")

    def _run(self, plan: _Plan, route: _Route, grads: list[Tensor], step_values: list[float],
             hyper: dict) -> None:
        members, gs, whole = route.members, route.grads, route.whole
        # Parameters at one step count share the scalars, and so one launch.
        by_step: dict[float, list[int]] = {}
        if members and step_values.count(step_values[members[0]]) == len(step_values):
            by_step[step_values[members[0]]] = members
        else:
            for i in members:
                by_step.setdefault(step_values[i], []).append(i)
            whole = False
        for step, idx in by_step.items():
            sub_gs = gs if len(by_step) == 1 else [grads[i] for i in idx]
            if route.kind == "triton":
                self._launch(route.kernel, plan, route.bucket, None if whole else tuple(idx),
                             idx, sub_gs, step, hyper)
            else:
                lp, lm, lv = ((col if whole else [col[i] for i in idx])
                              for col in (plan.local_p, plan.local_m, plan.local_v))
                lr, beta1, beta2 = hyper["lr"], hyper["beta1"], hyper["beta2"]
                route.kernel.adamw_step(lp, sub_gs, lm, lv, lr, beta1, beta2, hyper["eps"],
                                        hyper["weight_decay"], lr / (1 - beta1 ** step),
                                        math.sqrt(1 - beta2 ** step))
        for i in route.reference:
            adamw_reference(plan.local_p[i], grads[i], plan.local_m[i], plan.local_v[i],
                            step=step_values[i], **hyper)

    def _launch(self, mod, plan: _Plan, bucket: _Bucket, key, idx: list[int],
                grads: list[Tensor], step: float, hyper: dict) -> None:
        device = bucket.device
        tables = bucket.tables.get(key)
        if tables is None:
            tables = bucket.tables[key] = _Tables(
                tensors=_to_device(mod.tensor_table([plan.local_p[i] for i in idx],
                                                    [plan.local_m[i] for i in idx],
                                                    [plan.local_v[i] for i in idx]), device),
                chunks=_to_device(mod.chunk_table([plan.local_p[i].numel() for i in idx]),
                                  device),
                state_aligned=mod.aligned(plan.ptrs[j] for i in idx for j in
                                          (i, i + len(plan.params), i + 2 * len(plan.params))))
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if tables.stream is not None and stream != tables.stream:
            # The tables were copied (and may be freed) in the order of another stream.
            stream.wait_stream(tables.stream)
            for t in (tables.tensors, tables.chunks, tables.grads):
                if t is not None:
                    t.record_stream(stream)
        tables.stream = stream
        grad_ptrs = list(map(_data_ptr, grads))
        if tables.grads is None or grad_ptrs != tables.grad_ptrs:
            tables.grads = _to_device(torch.tensor(grad_ptrs, dtype=torch.int64), device)
            tables.grad_ptrs = grad_ptrs
            tables.grads_aligned = mod.aligned(grad_ptrs)
        kw = dict(dtype=bucket.dtype, aligned=tables.state_aligned and tables.grads_aligned,
                  step=step, **hyper)
        if device.type == "cuda" and device.index is not None \
                and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                mod.launch(tables.tensors, tables.grads, tables.chunks, **kw)
        else:
            mod.launch(tables.tensors, tables.grads, tables.chunks, **kw)

    # ------------------------------------------------------------------------ plans

    def _plan_valid(self, plan: _Plan, active: list[Tensor]) -> bool:
        if len(active) != len(plan.params) or not all(map(operator.is_, active, plan.params)):
            return False
        states = list(map(self.state.__getitem__, active))
        if not all(map(operator.is_, states, plan.states)):
            return False
        try:
            items = list(itertools.chain.from_iterable(map(_STATE_ITEMS, states)))
        except KeyError:
            return False
        if not all(map(operator.is_, items, plan.items)):
            return False
        if plan.dtensor:
            lp = [_local(p) for p in active]
            lm = [_local(t) for t in items[0::3]]
            lv = [_local(t) for t in items[1::3]]
            # to_local() hands out a fresh view each call; the step writes through these.
            plan.local_p, plan.local_m, plan.local_v = lp, lm, lv
        else:
            lp, lm, lv = plan.local_p, plan.local_m, plan.local_v
        return list(map(_data_ptr, itertools.chain(lp, lm, lv))) == plan.ptrs

    def _make_plan(self, active: list[Tensor]) -> _Plan:
        DTensor = _dtensor_type()
        states, values = [], []
        for p in active:
            st = self.state[p]
            if not st:
                # torch.optim.AdamW's layout, so state dicts move between the two.
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            missing = {"step", "exp_avg", "exp_avg_sq"} - set(st)
            if missing:
                raise ValueError(f"FusedAdamW: a parameter's state lacks {sorted(missing)}; "
                                 f"load an AdamW state dict, or clear the state of that "
                                 f"parameter (optimizer.state.pop(param)) to start it afresh")
            values.append(float(st["step"]))
            states.append(st)
        steps = torch.tensor(values, dtype=torch.float32)
        for st, view in zip(states, steps.unbind(0)):
            st["step"] = view
        dtensor = DTensor is not None and any(isinstance(p, DTensor) for p in active)
        local_p, local_m, local_v = [], [], []
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (p, st) in enumerate(zip(active, states)):
            m, v = st["exp_avg"], st["exp_avg_sq"]
            if dtensor and (isinstance(p, DTensor) or isinstance(m, DTensor)
                            or isinstance(v, DTensor)):
                if not (isinstance(p, DTensor) and isinstance(m, DTensor)
                        and isinstance(v, DTensor) and m.placements == p.placements
                        and v.placements == p.placements):
                    raise ValueError("FusedAdamW: a DTensor parameter's exp_avg and "
                                     "exp_avg_sq must be DTensors with its placements; load "
                                     "the state with the parameters' layout")
                p, m, v = p.to_local(), m.to_local(), v.to_local()
            for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
                if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                    raise ValueError(f"FusedAdamW: {name} is {t.dtype} {tuple(t.shape)} on "
                                     f"{t.device} for a {p.dtype} {tuple(p.shape)} parameter "
                                     f"on {p.device}; state must match its parameter (load "
                                     f"the state dict after moving the model)")
            local_p.append(p)
            local_m.append(m)
            local_v.append(v)
            groups[(p.device, p.dtype, _kernel_refusal(p, m, v))].append(i)
        buckets = [_Bucket(dev, dt, idx, why) for (dev, dt, why), idx in groups.items()]
        return _Plan(params=list(active), states=states,
                     items=list(itertools.chain.from_iterable(map(_STATE_ITEMS, states))),
                     steps=steps, local_p=local_p, local_m=local_m, local_v=local_v,
                     ptrs=list(map(_data_ptr, itertools.chain(local_p, local_m, local_v))),
                     dtensor=dtensor, buckets=buckets)


def _kernel_refusal(p: Tensor, m: Tensor, v: Tensor) -> str | None:
    """Why no fused kernel can update these (local) tensors, or ``None``."""
    dev = p.device.type
    kind = KERNEL_FOR_DEVICE.get(dev)
    dtype = str(p.dtype).removeprefix("torch.")
    if kind is None:
        return f"no kernel for device {dev!r}"
    if p.dtype not in (_TRITON_DTYPES if kind == "triton" else (torch.float32,)):
        return f"no {'Triton' if kind == 'triton' else 'C++'} kernel for {dtype}"
    if not (p.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
        return "parameter or state not contiguous"
    return None


def _local_grad(p: Tensor, g: Tensor) -> Tensor:
    if not hasattr(p, "to_local"):
        return g
    if not hasattr(g, "to_local") or g.placements != p.placements:
        got = getattr(g, "placements", "a plain tensor")
        raise ValueError(f"FusedAdamW: the gradient of a DTensor parameter with placements "
                         f"{p.placements} has {got}; redistribute it first "
                         f"(p.grad = p.grad.redistribute(placements=p.placements))")
    return g.to_local()


def _check_grad(g: Tensor, dtype: torch.dtype) -> None:
    """Raise for a gradient that neither a kernel nor the reference can step."""
    if g.is_sparse:
        raise RuntimeError("FusedAdamW does not support sparse gradients; use "
                           "torch.optim.SparseAdam")
    if g.dtype != dtype:
        raise TypeError(f"FusedAdamW: the gradient of a {dtype} parameter is {g.dtype}; as "
                        f"in torch.optim.AdamW(fused=True) they must match: cast it "
                        f"(p.grad = p.grad.to(p.dtype))")


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``: one non-blocking copy from pinned memory for CUDA (the
    pinned block is reused only after the copy has run)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
