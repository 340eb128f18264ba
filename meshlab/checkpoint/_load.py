"""Loading a checkpoint: everything is checked before anything is written.

In order, each phase ending with every rank agreeing (so a failure on one rank is a
``CheckpointError`` on all, never a hang):

1. find the committed directory (``_commit.resolve``), read and check its marker, check
   every listed file's size and this rank's share of the checksums, read ``.metadata``
   without running code and check where its shards lie, parse this rank's RNG states;
2. fit: compare the checkpoint's keys, shapes and dtypes with the model (and optimizer).
   Under pipeline parallelism each stage holds its own blocks: a rank checks the keys it
   owns, and a key of the checkpoint is unexpected only if no rank owns it;
3. DCP reads into the model's tensors in place; then the optimizer, scheduler, data
   position and RNG states are set from what phase 1 already checked.

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

from . import _rng
from . import _state
from ._commit import resolve
from ._files import LEGACY, MARKER, is_complete, rank_file, read_marker, verify
from ._inflight import wait
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


def _template(model: nn.Module, optimizer, src: _Source, weights: bool) -> tuple[dict, dict]:
    """The model's tensors (``weights``) and (when the checkpoint has optimizer state) the
    optimizer's, keyed as saved. Collective under ZeRO-1 (its state is assembled)."""
    template = dict(_state.model_state(model)) if weights else {}
    opt_all: dict = {}
    if optimizer is not None and (src.meta.get("optimizer") or {}).get("has_state", True):
        _state.ensure_state(optimizer)
        opt_all, _ = _state.optimizer_state(optimizer, model)
    return template, opt_all


def held_anywhere(keys: list[str], mine: dict, group) -> list[bool]:
    """For each checkpoint key, whether any rank's model (or optimizer) holds it."""
    flags = torch.tensor([1 if k in mine else 0 for k in keys], dtype=torch.int32)
    if distributed() and keys:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [bool(f) for f in flags.tolist()]


def _report(src: _Source, full: dict, with_optimizer: bool, group,
            weights: bool = True) -> LoadReport:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k: v for k, v in src.md.state_dict_metadata.items()
             if (with_optimizer or not k.startswith(_state.OPT_PREFIX))
             and (weights or k.startswith(_state.OPT_PREFIX))}
    keys = sorted(saved)
    missing = sorted(k for k in full if k not in saved)
    unexpected = [k for k, held in zip(keys, held_anywhere(keys, full, group)) if not held]
    mism = []
    for k, t in full.items():
        m = saved.get(k)
        if isinstance(m, TensorStorageMetadata):
            if tuple(m.size) != tuple(t.shape) or m.properties.dtype != t.dtype:
                mism.append((k, tuple(m.size), tuple(t.shape), str(m.properties.dtype),
                             str(t.dtype)))
        elif m is not None:
            mism.append((k, (), tuple(t.shape), type(m).__name__, str(t.dtype)))
    return LoadReport(missing, unexpected, mism)


def _fit(src: _Source, template: dict, opt_all: dict, optimizer, strict: bool, group,
         weights: bool = True):
    """Phase 2: the report, the tensors DCP will fill, and every check of what the rest
    of the load needs; every rank agrees before anything is written."""
    full = {**template, **opt_all}
    report, err = _report(src, full, bool(opt_all), group, weights), None
    try:
        if weights and src.meta.get("weights") is False:
            raise CheckpointError(f"{src.directory} holds optimizer state only (saved with "
                                  f"weights=False); load it with load(..., weights=False)")
        if strict and not report.ok:
            mesh = src.meta.get("mesh")
            raise CheckpointError(f"{src.directory} (saved on mesh {mesh}, "
                                  f"{src.meta.get('world_size')} ranks) does not fit:\n{report}")
        if optimizer is not None:
            _state.check_optimizer(optimizer, src.meta.get("optimizer") or {}, src.directory)
    except CheckpointError as e:
        err = e
    agree(group, "checkpoint.load: fit", error=err)
    bad = set(report.missing) | {m[0] for m in report.mismatched}
    return report, {k: v for k, v in full.items() if k not in bad}


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
    holds nothing else).
    """
    path = os.fspath(path).rstrip("/")
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
    template, opt_all = _template(model, optimizer, src, weights)
    report, fill = _fit(src, template, opt_all, optimizer, strict, group, weights)
    _read(src, fill, group, path)
    try:
        _apply(model, optimizer, scheduler, dataloader, src, fill, opt_all, strict, weights)
    except Exception as e:           # a scheduler that refuses its state, say
        err = as_error(e, "load", path)
    agree(group, "checkpoint.load: done", error=err)
    return src.meta.get("extra"), report


def _read(src: _Source, fill: dict, group, path: str) -> None:
    """Phase 3: DCP reads every tensor of ``fill`` in place."""
    from torch.distributed.checkpoint.api import CheckpointException
    import torch.distributed.checkpoint as dcp

    err = None
    try:
        dcp.load(fill, storage_reader=src.reader, process_group=group,
                 no_dist=not distributed())
    except (Exception, CheckpointException) as e:    # torch's is a BaseException
        err = as_error(e, "load", path)
    agree(group, "checkpoint.load: read", error=err)


def _apply(model, optimizer, scheduler, dataloader, src: _Source, fill: dict, opt_all: dict,
           strict: bool, weights: bool = True) -> None:
    if weights:
        model_keys = {k: v for k, v in fill.items() if not k.startswith(_state.OPT_PREFIX)}
        _state.set_model_state(model, model_keys, strict=strict)
    meta = src.meta
    if optimizer is not None:
        if not opt_all:                   # saved before the first step: no state yet
            _state.clear_state(optimizer)
        _state.load_optimizer_state(optimizer, opt_all, meta.get("optimizer") or {})
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(meta["scheduler"])
    if dataloader is not None and "dataloader" in meta:
        dataloader.load_state_dict(meta["dataloader"])
    if src.rng is not None:
        _rng.restore(src.rng)
