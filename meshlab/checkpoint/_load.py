"""Loading a checkpoint: everything is checked before anything is written.

In order, each phase ending with every rank agreeing (so a failure on one rank is a
``CheckpointError`` on all, never a hang):

1. find the committed directory (``_commit.resolve``), read and check its marker, check
   every listed file's size and this rank's share of the checksums, read ``.metadata``
   without running code and check where its shards lie, parse this rank's RNG states;
2. fit: compare the checkpoint's keys, shapes and dtypes with the model (names met
   through peft's renaming, ``_names``) and with the optimizer (``_opt``: the state the
   checkpoint holds, as ``Optimizer.load_state_dict`` takes it); check the optimizer's
   param groups and the scheduler's and data position's state against what they hold.
   Under pipeline parallelism each stage holds its own blocks: a rank checks the keys it
   owns, and a key of the checkpoint is unexpected only if no rank owns it;
3. DCP reads into the model's tensors in place (and into tensors made for the
   optimizer's state); then the optimizer, scheduler, data position and RNG states are
   set from what phases 1 and 2 already checked.

Only an I/O failure during phase 3 can leave a partial load; it is raised on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from . import _fourbit
from . import _names
from . import _opt
from . import _rng
from . import _state
from ._commit import resolve
from ._files import LEGACY, MARKER, is_complete, rank_file, read_marker, verify
from ._inflight import wait
from ._progress import bar, load_planner, shown
from ._ranks import agree, as_error, ctrl_group, distributed, enter, rank, world
from ._safe import CheckpointError, safe_reader


@dataclasses.dataclass
class LoadReport:
    """What did not match between a checkpoint and the model (``strict=False``)."""

    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, tuple, tuple, str, str]]   # fqn, saved, expected shape, dtypes

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = []
        if self.missing:
            lines.append(f"missing from the checkpoint: {self.missing}")
        if self.unexpected:
            lines.append(f"in the checkpoint but not in the model: {self.unexpected}")
        for fqn, s, e, sd, ed in self.mismatched:
            lines.append(f"{fqn}: saved {s} {sd}, expected {e} {ed}")
        return "\n".join(lines) or "checkpoint and model match"


@dataclasses.dataclass
class _Source:
    """A checked checkpoint (phase 1)."""

    directory: str
    meta: dict
    md: object                 # DCP Metadata
    reader: object
    rng: dict | None           # this rank's parsed RNG states, or None (not restored)

    @property
    def digest(self) -> str:
        return hashlib.sha256("\n".join(sorted(self.md.state_dict_metadata)).encode()
                              ).hexdigest()[:16]


def _open(path: str, trust_pickles: bool, restore_rng: bool) -> _Source:
    """Phase 1 on this rank (no collective)."""
    d = resolve(path, is_complete)
    meta = read_marker(path if d is None else d)      # raises when there is none
    files = meta.get("files")
    if meta["format"] == LEGACY:
        warnings.warn(f"{d} was written before meshlab recorded checksums: its files "
                      f"cannot be verified", stacklevel=3)
        sizes = None
    else:
        if ".metadata" not in files:
            raise CheckpointError(f"{d}/{MARKER} is damaged: it does not list .metadata; "
                                  f"load an older checkpoint")
        names = sorted(files)
        mine = set(names[rank()::world()]) | {".metadata", rank_file(rank())}
        sizes = verify(d, files, sorted(mine & set(names)))
    reader = safe_reader(d, trust_pickles, sizes)
    md = reader.read_metadata()
    rng = None
    if restore_rng and meta.get("world_size") == world():
        rng = _read_rng(d, files)
    return _Source(d, meta, md, reader, rng)


def _read_rng(d: str, files: dict | None) -> dict:
    import json

    name = rank_file(rank())
    where = os.path.join(d, name)
    if (files is not None and name not in files) or not os.path.isfile(where):
        raise CheckpointError(f"{where} is missing: the checkpoint was saved by as many ranks "
                              f"as this job has, so rank {rank()}'s random-number states "
                              f"belong to it; load with restore_rng=False to start them "
                              f"afresh, or load an older checkpoint")
    try:
        with open(where, "rb") as f:
            st = json.loads(f.read().decode())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where} is damaged: not a JSON document ({e}); load with "
                              f"restore_rng=False, or load an older checkpoint") from None
    return _rng.parse(st.get("rng") if isinstance(st, dict) else None, where)


def held_anywhere(keys: list[str], mine, group) -> list[bool]:
    """For each checkpoint key, whether any rank's model (or optimizer) holds it."""
    flags = torch.tensor([1 if k in mine else 0 for k in keys], dtype=torch.int32)
    if distributed() and keys:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [bool(f) for f in flags.tolist()]


@dataclasses.dataclass
class _Fit:
    """Phase 2's answer: the report and what phase 3 reads and sets."""

    report: LoadReport
    fill: dict[str, torch.Tensor]      # checkpoint key -> tensor DCP reads into
    model_sd: dict[str, torch.Tensor]  # the model's names -> their tensors, after the read
    copies: list[tuple[str, str]]      # (model name, checkpoint key read for another name)
    opt: _opt.OptimizerFit | None
    final: dict | None                 # fqn -> the optimizer state it ends up with


def _model_fit(src: _Source, model: nn.Module, weights: bool):
    """The model's side: its tensors, met with the checkpoint's names (``_names``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not weights:
        return {}, _names.align((), ()), {}, [], []
    template = dict(_state.model_state(model))
    md = src.md.state_dict_metadata
    saved = [k for k in md if not k.startswith(_state.OPT_PREFIX)]
    ties = _ties(model)
    al = _names.align(template, saved, [ties[n] for n in template if n in ties])
    _tied_sources(al, ties, set(saved))
    fill, copies, mism = {}, [], []
    for name, key in al.source.items():
        m, t = md[key], template[name]
        if not isinstance(m, TensorStorageMetadata):
            mism.append((name, (), tuple(t.shape), type(m).__name__, str(t.dtype)))
        elif tuple(m.size) != tuple(t.shape) or m.properties.dtype != t.dtype:
            mism.append((name, tuple(m.size), tuple(t.shape), str(m.properties.dtype),
                         str(t.dtype)))
        elif key in fill:
            copies.append((name, key))        # a module to save's two copies, say
        else:
            fill[key] = t
    return template, al, fill, copies, mism


def _ties(model: nn.Module) -> dict[str, str]:
    """Each tied weight's name -> the name it is tied to, both ways (the plan's record of
    a parallelized model; none for another)."""
    rt = _state.runtime_or_none(model)
    out: dict[str, str] = {}
    for e in rt.plan.params if rt is not None else ():
        if e.tied_to:
            out[e.fqn], out[e.tied_to] = e.tied_to, e.fqn
    return out


def _tied_sources(al, ties: dict[str, str], saved: set[str]) -> None:
    """A tied weight the file holds under the other name only loads from it: a pipeline
    holds a tied head by the embedding's name (or, under FSDP2, as a copy of its own), so
    one side of the tie is in a checkpoint saved with a pipeline and both without one."""
    still = []
    for m in al.missing:
        other = ties.get(m)
        if other in saved:
            al.source[m] = other
            al.used.add(other)
        else:
            still.append(m)
    al.missing[:] = still


def _stateful(src: _Source, name: str, obj) -> str | None:
    """Why the checkpoint's ``name`` state (scheduler, data position) cannot be loaded
    into ``obj``, or None: it must hold what ``obj`` holds, in the same form."""
    if obj is None or name not in src.meta:
        return None
    saved, own = src.meta[name], obj.state_dict()
    differs = _state.same_shape(saved, own, f"{name} state")
    if not differs and name == "scheduler" and _is_lr_scheduler(obj):
        differs = _state.check_scheduler(saved, own)
    return (f"{src.directory}/{MARKER}: its {differs} ({type(obj).__name__}); pass the "
            f"{name} the saved run used, or load without it ({name}=None)") if differs else None


def _scheduler_sources(src: _Source, scheduler, optimizer, model) -> list[int] | None:
    """Each param group's saved group (``_state.group_sources``) of the optimizer the
    scheduler drives, where the checkpoint names the saved groups' parameters; else None."""
    opt = optimizer if optimizer is not None else getattr(scheduler, "optimizer", None)
    rest = src.meta.get("optimizer") or {}
    if opt is None or not isinstance(rest.get("group_names"), list) or \
            len(rest["group_names"]) != len(getattr(opt, "inner", opt).param_groups):
        return None
    return _state.group_sources(opt, model, rest, src.directory)


def _is_lr_scheduler(obj) -> bool:
    from torch.optim import lr_scheduler as L

    return isinstance(obj, (L.LRScheduler, L.ReduceLROnPlateau))


def _fit(src: _Source, model, optimizer, scheduler, dataloader, strict: bool, group,
         weights: bool = True) -> _Fit:
    """Phase 2: the report, the tensors DCP will fill, and every check of what the rest
    of the load needs; every rank agrees before anything is written."""
    template, al, fill, copies, mism = _model_fit(src, model, weights)
    of = _opt.fit(optimizer, model, src, strict) if optimizer is not None else None
    md = src.md.state_dict_metadata
    keys = sorted(k for k in md if not k.startswith(_state.OPT_PREFIX)) if weights else []
    opt_keys = sorted(k for k in md if k.startswith(_state.OPT_PREFIX)) if of else []
    held = held_anywhere(keys + opt_keys, al.used | (of.used if of else set()), group)
    unexpected = [k for k, h in zip(keys + opt_keys, held) if not h]
    missing = sorted(al.missing) + (of.missing if of else [])
    missing += [n for n, obj in (("scheduler", scheduler), ("dataloader", dataloader))
                if obj is not None and n not in src.meta]
    report = LoadReport(missing, unexpected, mism + (of.mismatched if of else []))
    final, err = None, None
    try:
        if weights and src.meta.get("weights") is False:
            raise CheckpointError(f"{src.directory} holds optimizer state only (saved with "
                                  f"weights=False); load it with load(..., weights=False)")
        if weights:
            mine = set(keys)
            _names.check(al, [k for k in unexpected if k in mine], src.directory)
            _fourbit.check(src.meta.get("quantized"), model, al.source, src.directory)
        if strict and not report.ok:
            mesh = src.meta.get("mesh")
            raise CheckpointError(f"{src.directory} (saved on mesh {mesh}, "
                                  f"{src.meta.get('world_size')} ranks) does not fit:\n{report}")
        if of is not None and of.saved:
            _state.check_optimizer(optimizer, src.meta.get("optimizer") or {}, src.directory,
                                   model)
            final = _opt.final_state(of, strict)
            _opt.check_buckets(optimizer, model, final, src.directory)
        if scheduler is not None and "scheduler" in src.meta:
            src.meta["scheduler"] = _state.scheduler_by_groups(
                src.meta["scheduler"], _scheduler_sources(src, scheduler, optimizer, model),
                src.directory)
        for name, obj in (("scheduler", scheduler), ("dataloader", dataloader)):
            why = _stateful(src, name, obj)
            if why:
                raise CheckpointError(why)
    except CheckpointError as e:
        err = e
    agree(group, "checkpoint.load: fit", error=err)
    fill.update(of.fill if of else {})
    return _Fit(report, fill, template, copies, of, final)


def load(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None, *,
         dataloader=None, strict: bool = True, trust_pickles: bool = False,
         restore_rng: bool = True, timeout: float = 300.0, weights: bool = True):
    """Load a checkpoint saved on any mesh into ``model`` (and the rest) laid out on this one.

    Returns ``(extra, report)``. ``strict`` raises ``CheckpointError`` naming each missing
    or unexpected key and each shape or dtype mismatch; ``strict=False`` loads what fits
    and returns the report. Damaged, missing or misplaced files raise a
    ``CheckpointError`` naming the file, before anything is written. Pickled objects
    are refused unless ``trust_pickles``. RNG states are restored when the checkpoint was
    saved by as many ranks (``restore_rng``). ``weights=False`` leaves the model's
    tensors as they are and loads the rest (a checkpoint saved with ``weights=False``
    holds nothing else). Rank 0 shows the tensors it reads as a progress bar
    (``MESHLAB_PROGRESS``, ``core.progress``).
    """
    path = os.fspath(path).rstrip("/")
    show = shown()                       # MESHLAB_PROGRESS checked alike on every rank
    wait()
    enter("load", path, model, timeout)
    group = ctrl_group(model)
    src, err = None, None
    try:
        src = _open(path, trust_pickles, restore_rng)
    except Exception as e:
        err = as_error(e, "load", path)
    agree(group, "checkpoint.load: check",
          {"checkpoint keys": src.digest if src else None, "strict": strict,
           "optimizer": optimizer is not None}, err)
    fit = _fit(src, model, optimizer, scheduler, dataloader, strict, group, weights)
    _read(src, fit.fill, group, path, show)
    try:
        _apply(model, optimizer, scheduler, dataloader, src, fit, strict, weights)
    except Exception as e:           # checked in phase 2: an I/O or device failure
        err = as_error(e, "load", path)
    agree(group, "checkpoint.load: done", error=err)
    return src.meta.get("extra"), fit.report


def _read(src: _Source, fill: dict, group, path: str, show: bool = False) -> None:
    """Phase 3: DCP reads every tensor of ``fill`` in place (``show``: a bar counts them)."""
    from torch.distributed.checkpoint.api import CheckpointException
    import torch.distributed.checkpoint as dcp

    err = None
    try:
        with bar(None, "load", unit="tensor", on=show) as b:
            dcp.load(fill, storage_reader=src.reader, process_group=group,
                     no_dist=not distributed(), planner=load_planner(b))
    except (Exception, CheckpointException) as e:    # torch's is a BaseException
        err = as_error(e, "load", path)
    agree(group, "checkpoint.load: read", error=err)


def _apply(model, optimizer, scheduler, dataloader, src: _Source, fit: _Fit,
           strict: bool, weights: bool = True) -> None:
    """Phase 3, after the read: set what phases 1 and 2 checked."""
    if weights:
        with torch.no_grad():
            for name, key in fit.copies:
                fit.model_sd[name].copy_(fit.fill[key])
        # every name the model holds: what did not load is the model's own tensor
        _state.set_model_state(model, fit.model_sd, strict=strict)
    meta = src.meta
    if fit.opt is not None and fit.opt.saved:
        values = {n: {k: v if isinstance(v, torch.Tensor) else fit.fill[v]
                      for k, v in per.items()} for n, per in fit.final.items()}
        _opt.set_state(optimizer, model, values, meta.get("optimizer") or {})
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(_state.restored(meta["scheduler"], scheduler.state_dict()))
    if dataloader is not None and "dataloader" in meta:
        dataloader.load_state_dict(meta["dataloader"])
    if src.rng is not None:
        _rng.restore(src.rng)
