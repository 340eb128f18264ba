"""``verify``: a layout trained beside a reference it must equal, in the same job.

Each rank builds the layout (``parallelize`` of a copy of the model) and a reference from
the same seed: by default the whole model on this one process, stepped on the whole global
batch; or the same model parallelized on a smaller mesh where it does not fit one process.
Both take the same optimizer (SGD by default: Adam divides each update by the gradient's
own magnitude, which turns rounding in a near-zero gradient into a full step), the layout
through ``meshlab.step``. Per step the report holds both losses, every parameter's
gradient and weight difference, and the first module whose output diverges (forward hooks
on both models, compared in the reference's execution order). A missing reduction, a
wrong shard or a wrong forward then has a name, not a loss curve that drifts.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..apply.materialize import init_weights
from ..apply.parallelize import parallelize
from ..core.agree import agree
from ..core.digest import batch_entry
from ..core.errors import ConfigError, MeshlabError, check_int
from ..transforms._install import runtime_of
from ..transforms.lora import Lora
from ..transforms.precision import Precision
from ..transforms.precision._float8 import Float8Layers, convert as convert_float8
from . import _watch
from ._verify_report import Diff, StepDiff, VerifyReport
from .optimizer import optimizer as mesh_optimizer
from .step import _call, _loss, step as mesh_step

# Default tolerances by the dtype the layout computes in, ``(atol, rtol)`` against the
# largest magnitude of each reference tensor. float64: rounding in another reduction
# order is ~1e-16 relative, so 1e-9 is a missing or doubled term, never rounding. float32:
# ~1e-7 per operation, and a gradient read from an SGD update carries the weights'
# rounding divided by the learning rate. bf16 keeps 8 bits of mantissa (2^-8 = 3.9e-3),
# fp16 11 (4.9e-4): a few units of the last place, summed over a block's operations.
TOLERANCE = {torch.float64: (1e-9, 1e-7), torch.float32: (1e-5, 1e-4),
             torch.bfloat16: (1e-3, 3e-2), torch.float16: (2e-4, 4e-3)}


def verify(model: nn.Module, spec, mesh=None, batch=None, steps: int | None = None, *,
           loss_fn: Callable | None = None, inputs=None, microbatches: int = 1,
           optimizer: type = torch.optim.SGD, lr: float = 0.1,
           optimizer_options: Mapping | None = None, dtype: torch.dtype | None = None,
           seed: int = 0, reference=None, atol: float | None = None,
           rtol: float | None = None, modules: bool = True) -> VerifyReport:
    """Train ``spec`` on ``mesh`` beside a reference for ``steps`` steps; returns a
    ``VerifyReport`` (``ok``, a table per step, the first diverging module).

    ``model``: the model as given to ``parallelize`` (on the meta device, or with real
    weights, the same on every rank); it is copied, never changed. ``batch``: the global
    batch (a dict of tensors or a tensor), the same on every rank; each data rank of the
    layout steps on its share, the reference on all of it. A list of batches is one per
    step (``steps`` defaults to 3 for one batch). ``loss_fn``, ``inputs``, ``microbatches``:
    as ``meshlab.step``.

    ``reference``: ``None`` (default): the single process, built on every rank from
    ``seed`` (refused by name where its weights, gradients and optimizer state would not
    fit this rank's free memory); ``(spec, mesh)``: the same model parallelized with that
    spec on a smaller mesh (e.g. ``mesh.sub('tp')``: each tensor-parallel group trains it
    on the whole batch); or a module you built on this process (e.g. single-process peft).
    It computes under the autocast of the layout's ``precision()`` and scales its loss as
    the layout's loss scaler does.

    ``optimizer(params, lr=lr, **optimizer_options)`` on both sides (plain SGD reports
    gradients, read from each update; any other optimizer reports updates).
    ``dtype=torch.float64`` runs both in float64 (on the CPU: exact to rounding, so any
    difference is a bug). ``atol``/``rtol`` default by dtype (``TOLERANCE``). ``modules``:
    compare module outputs (forward hooks; off: losses, gradients and weights only).

    >>> report = ml.verify(model, spec, mesh, batch, dtype=torch.float64)  # doctest: +SKIP
    >>> report.ok, report.first_module                                     # doctest: +SKIP
    (False, 'model.layers.0.mlp.down_proj')
    """
    batches = _batches(batch, steps)
    check_int(microbatches, "verify", "microbatches", example=1)
    if dtype is not None and dtype not in TOLERANCE:
        raise ConfigError(f"verify(dtype={dtype!r}): one of torch.float64, torch.float32, "
                          f"torch.bfloat16, torch.float16, or None for the model's own")
    _check_reference(reference)
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ConfigError(f"verify(optimizer={optimizer!r}): an optimizer class such as "
                          f"torch.optim.SGD (the default)")
    options = dict(optimizer_options or {})
    with _default_dtype(dtype):
        layout = parallelize(_copy(model, dtype), spec, mesh, seed=seed)
        rt = runtime_of(layout)
        _agree_batches(rt, batches)
        batches = [_cast(b, dtype) for b in batches]
        lay = _Laid(layout, mesh_optimizer(layout, optimizer, lr=lr, **options), rt)
        ref, ref_text = _reference(reference, model, dtype, seed, rt, optimizer, lr, options,
                                   lay)
        a, r = TOLERANCE[_compute_dtype(rt, dtype or _model_dtype(model))]
        a, r = (a if atol is None else atol), (r if rtol is None else rtol)
        run = _Run(lay, ref, rt, a, r, loss_fn, inputs, microbatches, modules, lr,
                   _reports_gradients(optimizer, options))
        start, steps_out = run.train(batches)
    return VerifyReport(layout=f"{spec!r} on {rt.mesh!r}", reference=ref_text, atol=a, rtol=r,
                        gradient="gradient" if run.gradients else "update", start=start,
                        steps=steps_out, notes=tuple(run.notes + _prec_notes(rt, ref.model)))


# -- the two sides ---------------------------------------------------------------------
class _Laid:
    """A parallelized model: steps through ``meshlab.step`` on its data rank's share."""

    def __init__(self, model, opt, rt):
        self.model, self.opt, self.rt = model, opt, rt
        self.dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
        self.watch = None

    def share(self, batch):
        return _chunk(batch, self.rt.dp_size, self.dp_rank)

    def end(self, batch) -> int:
        """The sample of the global batch this rank's share ends before."""
        return (self.dp_rank + 1) * _samples(batch) // self.rt.dp_size

    def samples(self, batch) -> int:
        return _samples(batch) // self.rt.dp_size

    def step(self, batch, loss_fn, inputs, microbatches) -> float:
        return mesh_step(self.model, self.opt, self.share(batch), loss_fn,
                         microbatches=microbatches, inputs=inputs)

    def scale(self) -> float:
        scaler = getattr(self.opt, "scaler", None)
        return float(scaler.scale) if scaler is not None else 1.0

    def weights(self) -> dict[str, torch.Tensor]:
        return _weights(self.model)


class _Single:
    """The reference on this one process: the whole global batch, under the layout's
    autocast, its loss scaled as the layout's is."""

    def __init__(self, model, opt, autocast, scale_of):
        self.model, self.opt, self.autocast, self.scale_of = model, opt, autocast, scale_of
        self.watch = None

    def end(self, batch) -> int:
        return _samples(batch)

    def samples(self, batch) -> int:
        return _samples(batch)

    def step(self, batch, loss_fn, inputs, microbatches) -> float:
        scale = self.scale_of()
        with self.autocast():
            loss = _loss(loss_fn, _call(self.model, batch, inputs), batch)
        (loss * scale if scale != 1.0 else loss).backward()
        if scale != 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(scale)
        self.opt.step()
        self.opt.zero_grad()
        return float(loss)

    def weights(self) -> dict[str, torch.Tensor]:
        return _weights(self.model)


def _reference(reference, model, dtype, seed, rt, optimizer, lr, options, lay):
    """The reference side and how the report names it."""
    kind = f"{'float64 ' if dtype == torch.float64 else ''}"
    if reference is None:
        _check_fits(model, rt, optimizer, options, dtype)

        def init(m, on_module=None):
            return init_weights(m, seed, device=str(rt.device), on_module=on_module) \
                if _on_meta(m) else m.to(rt.device)

        adapters = rt.plan.get(Lora)
        # with adapters, the one process trains the same adapters on the same base
        ref = adapters.single_process(rt.plan, _copy(model, dtype), init) \
            if adapters is not None else init(_copy(model, dtype))
        prec = rt.plan.get(Precision)
        if prec is not None and prec.float8 is not None:    # the same layers in float8
            convert_float8(ref, rt.plan.decision(Float8Layers))
    elif isinstance(reference, nn.Module):
        ref = reference
    elif isinstance(reference, tuple) and len(reference) == 2:
        ref_spec, ref_mesh = reference
        ref_model = parallelize(_copy(model, dtype), ref_spec, ref_mesh, seed=seed)
        side = _Laid(ref_model, mesh_optimizer(ref_model, optimizer, lr=lr, **options),
                     runtime_of(ref_model))
        return side, f"{kind}{ref_spec!r} on {ref_mesh!r}"
    params = [p for p in ref.parameters() if p.requires_grad]
    side = _Single(ref, optimizer(params, lr=lr, **options), lambda: _autocast(rt), lay.scale)
    return side, f"{kind}one process".strip()


def _check_reference(reference) -> None:
    ok = reference is None or isinstance(reference, nn.Module) or (
        isinstance(reference, tuple) and len(reference) == 2)
    if not ok:
        raise ConfigError(f"verify(reference={reference!r}): None (the single process), "
                          f"(spec, mesh) (the same model on a smaller mesh), or a module "
                          f"built on this process")


class _Run:
    """The steps of both sides and their comparison."""

    def __init__(self, lay, ref, rt, atol, rtol, loss_fn, inputs, microbatches, modules, lr,
                 gradients):
        self.lay, self.ref, self.rt, self.atol, self.rtol = lay, ref, rt, atol, rtol
        self.loss_fn, self.inputs, self.mb, self.modules = loss_fn, inputs, microbatches, modules
        self.lr, self.gradients = lr, gradients
        self.notes: list[str] = []
        self.skipped: dict[str, None] = {}     # module outputs not compared, in order
        self._after: tuple = ({}, {})          # both sides' weights after the last step

    def train(self, batches) -> tuple[tuple[Diff, ...], tuple[StepDiff, ...]]:
        lay_w, ref_w = self.lay.weights(), self.ref.weights()
        order = list(ref_w)
        start = self._merge(self._diffs(lay_w, ref_w), order)
        self._note_names(lay_w, ref_w)
        if self.modules:
            self.ref.watch = _watch.Watch(self.ref.model, 0)
            gather = _watch.plan_gather(self.rt, self.ref.watch, self.ref.samples(batches[0]))
            self.lay.watch = _watch.Watch(self.lay.model, 0, gather)
            self.notes += self.lay.watch.skipped
        out = []
        try:
            for i, b in enumerate(batches, 1):
                out.append(self._step(i, b, lay_w, ref_w, order))
                lay_w, ref_w = self._after
        finally:
            for side in (self.lay, self.ref):
                if side.watch is not None:
                    side.watch.close()
        self.notes = self._everyone(self.notes)        # pipeline stages see other modules
        names = self._everyone(list(self.skipped))
        if names:
            self.notes.append(f"{len(names)} module outputs are shards of the reference's in "
                              f"a layout the plan does not record, not compared: "
                              f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
        return start, tuple(out)

    def _step(self, i, batch, lay_w, ref_w, order) -> StepDiff:
        for side in (self.ref, self.lay):
            if side.watch is not None:
                side.watch.reset(side.end(batch))
        ref_loss = self.ref.step(batch, self.loss_fn, self.inputs, self.mb)
        loss = self.lay.step(batch, self.loss_fn, self.inputs, self.mb)
        mods, first = (), None
        if self.modules:
            diffs, skipped = _watch.compare(self.lay.watch, self.ref.watch,
                                            self.ref.samples(batch), self.atol, self.rtol)
            self.skipped.update(dict.fromkeys(skipped))
            mods = self._merge({d.name: d for d in diffs},
                               [n for n, _ in sorted(self.ref.watch.records.items(),
                                                     key=lambda kv: kv[1].order)])
            first = next((d for d in mods if not d.ok), None)
        new_lay, new_ref = self.lay.weights(), self.ref.weights()
        self._after = new_lay, new_ref
        div = self.lr if self.gradients else 1.0
        grads = self._diffs({n: (lay_w[n] - t) / div for n, t in new_lay.items() if n in lay_w},
                            {n: (ref_w[n] - t) / div for n, t in new_ref.items() if n in ref_w})
        return StepDiff(i, loss, ref_loss, abs(loss - ref_loss) <= self.atol + self.rtol *
                        abs(ref_loss), self._merge(grads, order),
                        self._merge(self._diffs(new_lay, new_ref), order), mods, first)

    def _diffs(self, got: dict, want: dict) -> dict[str, Diff]:
        out = {}
        for n, t in got.items():
            if n in want:
                d = (t - want[n]).abs().max().item() if t.numel() else 0.0
                s = want[n].abs().max().item() if t.numel() else 0.0
                out[n] = Diff(n, d, s, d <= self.atol + self.rtol * s)
        return out

    def _merge(self, mine: dict[str, Diff], order: list[str]) -> tuple[Diff, ...]:
        """Every rank's diffs as one, in ``order`` (the worst over the ranks that hold a
        value: pipeline stages hold their own parameters)."""
        parts = [mine]
        if dist.is_initialized() and dist.get_world_size(self.rt.ctrl_group) > 1:
            parts = [None] * dist.get_world_size(self.rt.ctrl_group)
            dist.all_gather_object(parts, mine, group=self.rt.ctrl_group)
        merged: dict[str, Diff] = {}
        for part in parts:
            for n, d in part.items():
                old = merged.get(n)
                merged[n] = d if old is None else Diff(
                    n, max(old.max_abs, d.max_abs), max(old.scale, d.scale), old.ok and d.ok)
        rank = {n: i for i, n in enumerate(order)}
        return tuple(sorted(merged.values(), key=lambda d: rank.get(d.name, len(rank))))

    def _everyone(self, items: list) -> list:
        """``items`` of every rank, in rank order, each once."""
        parts = [items]
        if dist.is_initialized() and dist.get_world_size(self.rt.ctrl_group) > 1:
            parts = [None] * dist.get_world_size(self.rt.ctrl_group)
            dist.all_gather_object(parts, items, group=self.rt.ctrl_group)
        return list(dict.fromkeys(x for part in parts for x in part))

    def _note_names(self, lay_w, ref_w) -> None:
        held = set(self._everyone(list(lay_w)))
        for what, names in (("the layout has no", sorted(set(ref_w) - held)),
                            ("the reference has no", sorted(held - set(ref_w)))):
            if names:
                self.notes.append(f"{what} parameter {', '.join(names[:6])}"
                                  f"{' ...' if len(names) > 6 else ''}: not compared")


# -- helpers ---------------------------------------------------------------------------
def _batches(batch, steps) -> list:
    if batch is None:
        raise ConfigError("verify(model, spec, mesh, batch): give the global batch (a dict of "
                          "tensors, or a tensor), the same on every rank")
    if isinstance(batch, (list, tuple)) and not isinstance(batch, torch.Tensor):
        if not batch or (steps is not None and steps != len(batch)):
            raise ConfigError(f"verify(batch=[{len(batch)} batches], steps={steps}): a list "
                              f"of batches is one per step; give as many batches as steps, "
                              f"or leave steps out")
        return list(batch)
    n = 3 if steps is None else check_int(steps, "verify", "steps", example=3)
    return [batch] * n


def _samples(batch) -> int:
    t = batch if isinstance(batch, torch.Tensor) else next(
        (v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    if t is None or t.dim() == 0:
        raise ConfigError("verify: the batch holds no tensor with a batch dimension (dim 0)")
    return t.shape[0]


def _chunk(batch, k: int, i: int):
    """Rank ``i``'s share of ``batch`` cut into ``k`` along dim 0."""
    if k == 1:
        return batch
    n = _samples(batch)
    if n % k:
        raise ConfigError(f"verify: the global batch holds {n} samples, which do not divide "
                          f"over the layout's {k} data ranks; give a batch of a multiple of "
                          f"{k} samples")
    if isinstance(batch, torch.Tensor):
        return batch.chunk(k)[i]
    return {key: v.chunk(k)[i] if isinstance(v, torch.Tensor) else v for key, v in batch.items()}


def _cast(batch, dtype):
    if dtype is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    return {k: _cast(v, dtype) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _agree_batches(rt, batches) -> None:
    """Every rank holds the same global batches, or every rank raises."""
    error = None
    try:
        for b in batches:
            if not isinstance(b, (torch.Tensor, Mapping)):
                raise ConfigError(f"verify: a batch is a tensor or a dict of tensors, got "
                                  f"{type(b).__name__}")
            _samples(b)
    except MeshlabError as e:
        error = e
    agree(rt.ctrl_group, "verify", {"steps": len(batches)}, error,
          peers=batch_entry(batches, {}, "verify's global batches"))


def _copy(model: nn.Module, dtype) -> nn.Module:
    out = copy.deepcopy(model)
    return out.to(dtype) if dtype is not None else out


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@contextlib.contextmanager
def _default_dtype(dtype):
    """Tensors the forwards make (masks, positions) in ``dtype`` too."""
    if dtype is None or not dtype.is_floating_point or dtype in (torch.bfloat16, torch.float16):
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _compute_dtype(rt, dtype) -> torch.dtype:
    prec = rt.plan.get(Precision)
    if prec is not None and prec.compute != "float32":
        return getattr(torch, prec.compute)
    return dtype if dtype in TOLERANCE else torch.float32


def _autocast(rt):
    prec = rt.plan.get(Precision)
    if prec is None or prec.compute == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=rt.device.type, dtype=getattr(torch, prec.compute))


def _prec_notes(rt, reference: nn.Module) -> list[str]:
    prec = rt.plan.get(Precision)
    if prec is None or prec.compute == "float32":
        return []
    casts = any(p.casts_params for p in rt.parts)
    notes = [f"the reference computes under torch.autocast({prec.compute}); the layout "
             + ("casts the parameters (FSDP2's mixed precision)" if casts else
                "under the same autocast")]
    if prec.float8 is not None:
        n = len(rt.plan.decision(Float8Layers).layers)
        ref = sum(type(m).__name__ == "Float8Linear" for m in reference.modules())
        both = (f"both run the same {n} linear layers in float8" if ref == n else
                f"the layout runs {n} linear layers in float8, the reference {ref}")
        notes.append(f"{both} (torchao, recipe {prec.float8!r}); a dynamic scale is taken "
                     f"over each rank's own batch")
    return notes


def _reports_gradients(optimizer, options) -> bool:
    """Plain SGD: a step's update is -lr times the gradient, so the gradient is read from
    it (ZeRO-1's slices, offloaded and stepped-in-backward gradients alike)."""
    plain = all(not options.get(k) for k in ("momentum", "weight_decay", "nesterov",
                                               "maximize"))
    return optimizer is torch.optim.SGD and plain


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, whole (DTensors gathered), in float64."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[_watch.clean(n)] = t.to(torch.float64, copy=True).cpu()
    return out


def _check_fits(model, rt, optimizer, options, dtype) -> None:
    """The single-process reference holds the whole model's weights, gradients and
    optimizer state on this rank: refuse, with the fix, where they do not fit."""
    per = (dtype or _model_dtype(model)).itemsize
    state = 0 if optimizer is torch.optim.SGD and not options.get("momentum") else 2
    need = sum(p.numel() for p in model.parameters()) * per * (2 + state)
    free = _free_bytes(rt.device)
    if free is not None and need > free:
        raise ConfigError(
            f"verify: the single-process reference needs {need / 2**30:.1f} GiB for weights, "
            f"gradients and optimizer state, and this rank has {free / 2**30:.1f} GiB free; "
            f"pass reference=(spec, smaller_mesh), the same model on fewer ranks (e.g. "
            f"reference=(ml.shard(...), mesh.sub('tp')))")


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
