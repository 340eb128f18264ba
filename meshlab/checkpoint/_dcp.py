"""Sharded, atomic, optionally asynchronous checkpoints over torch.distributed.checkpoint.

A checkpoint is a directory. Every rank writes only its shards (DCP); meshlab adds
``rank-XXXXX.json`` (this rank's RNG states) and, last, ``meshlab.json``: the commit
marker, holding everything that is not a tensor (optimizer hyper-parameters, loss
scaler, scheduler, data position, user ``extra``). The directory is written as
``<path>.partial`` and renamed into place by rank 0 only after every rank finished, so
a crash at any moment leaves either the old state or the new one; a directory without
``meshlab.json`` is never loaded.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ._safe import CheckpointError, safe_reader
from . import _state

MARKER = "meshlab.json"
FORMAT = "meshlab.checkpoint/1"


# -- collective hygiene -----------------------------------------------------------------
def _ctrl_group(model):
    rt = getattr(model, "_meshlab", None)
    return getattr(rt, "ctrl_group", None) if rt is not None else None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _enter(what: str, path: str, model, timeout: float) -> None:
    """Every rank must call ``what`` with the same path; otherwise fail within
    ``timeout`` seconds, naming what went wrong, instead of hanging in a collective."""
    if not _distributed():
        return
    group = _ctrl_group(model)
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout),
                               wait_all_ranks=True)
    except RuntimeError as e:
        raise CheckpointError(
            f"{what}() is collective: every rank must call it, but not all of the "
            f"{dist.get_world_size()} ranks entered within {timeout:.0f} s ({e})") from None
    h = int(hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12], 16)
    mine = torch.tensor([h], dtype=torch.int64)
    allh = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(allh, mine, group=group)
    if len({int(x) for x in allh}) != 1:
        raise CheckpointError(f"{what}(): ranks passed different paths; every rank must pass "
                              f"the same directory (this rank: {path})")


def _barrier(model) -> None:
    if _distributed():
        dist.barrier(group=_ctrl_group(model))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _fault(point: str) -> None:
    """Fault injection for the reliability tests: MESHLAB_FAULT=<point>:<rank> kills that
    rank with SIGKILL when it reaches ``point``."""
    spec = os.environ.get("MESHLAB_FAULT")
    if spec and spec == f"{point}:{_rank()}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- RNG ----------------------------------------------------------------------------------
def _rng_state() -> dict:
    st = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
          "python": _to_json(random.getstate()),
          "numpy": _to_json(np.random.get_state())}
    if torch.cuda.is_available():
        st["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                      for s in torch.cuda.get_rng_state_all()]
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(st["torch"])),
                                         dtype=torch.uint8))
    v = st["python"]
    random.setstate((v[0], tuple(v[1]), v[2]))
    n = st["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)),
                                                       dtype=torch.uint8) for s in st["cuda"]])


def _to_json(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (tuple, list)):
        return [_to_json(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


# -- save ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _Pending:
    thread: threading.Thread
    error: list

    def wait(self) -> None:
        self.thread.join()
        if self.error:
            raise CheckpointError(f"the asynchronous save failed: {self.error[0]}")


_IN_FLIGHT: list[_Pending] = []


def wait() -> None:
    """Block until the asynchronous save in flight (if any) is committed."""
    while _IN_FLIGHT:
        _IN_FLIGHT.pop().wait()


def _collect(model, optimizer, scheduler, extra, dataloader) -> tuple[dict, dict]:
    tensors = dict(_state.model_state(model))
    meta: dict[str, Any] = {"format": FORMAT, "world_size": _world(), "time": time.time()}
    rt = getattr(model, "_meshlab", None)
    if rt is not None:
        meta["mesh"] = dict(rt.mesh.shape)
        meta["transforms"] = list(rt.plan.transforms)
    if optimizer is not None:
        _state.ensure_state(optimizer)
        opt_t, rest = _state.optimizer_state(optimizer, model)
        tensors.update(opt_t)
        meta["optimizer"] = rest
    if scheduler is not None:
        meta["scheduler"] = _state._jsonable(scheduler.state_dict(), "scheduler.state_dict()")
    if dataloader is not None:
        meta["dataloader"] = dataloader.state_dict()
    if extra is not None:
        meta["extra"] = _state._jsonable(extra, "extra")
    return tensors, meta


def save(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None,
         extra: dict | None = None, *, dataloader=None, overwrite: bool = False,
         keep_last: int | None = None, async_save: bool = False,
         timeout: float = 300.0) -> str:
    """Save a sharded checkpoint into directory ``path``; every rank calls it.

    ``extra`` (JSON) is for the user's own state (``{'step': 100}``). ``async_save``
    copies the state to CPU before returning and writes it in the background (at most
    one save in flight: a new save first waits for the last). ``keep_last=k`` deletes
    older complete checkpoints next to ``path``, never the newest valid one.
    """
    path = os.fspath(path).rstrip("/")
    wait()
    _enter("save", path, model, timeout)
    exists = torch.tensor([1 if os.path.exists(os.path.join(path, MARKER)) else 0])
    if _distributed():
        dist.all_reduce(exists, group=_ctrl_group(model))
    if int(exists) and not overwrite:
        raise CheckpointError(f"{path} already holds a checkpoint; pass overwrite=True to "
                              f"replace it, or save to a new step directory")
    tmp = path + ".partial"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(model)
    tensors, meta = _collect(model, optimizer, scheduler, extra, dataloader)
    rng = _rng_state()
    if async_save:
        # Stage: copy every local shard now, so later updates cannot reach the file.
        staged = {k: _stage(v) for k, v in tensors.items()}
        errors: list = []
        thread = threading.Thread(target=_finish, name="meshlab-save",
                                  args=(staged, meta, rng, path, tmp, model, keep_last,
                                        overwrite, errors))
        _IN_FLIGHT.append(_Pending(thread, errors))
        thread.start()
        return path
    _finish(tensors, meta, rng, path, tmp, model, keep_last, overwrite, None)
    return path


def _stage(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return DTensor.from_local(t.to_local().detach().to("cpu", copy=True), t.device_mesh,
                                  t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _finish(tensors, meta, rng, path, tmp, model, keep_last, overwrite, errors) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        group = _ctrl_group(model) if errors is not None else None
        dcp.save(tensors, checkpoint_id=tmp, process_group=group,
                 no_dist=not _distributed())
        _fault("after_write")
        _write_json(os.path.join(tmp, f"rank-{_rank():05d}.json"), {"rng": rng})
        _barrier(model)
        if _rank() == 0:
            _write_json(os.path.join(tmp, MARKER), meta)
            _fault("before_rename")
            if overwrite and os.path.exists(path):
                old = path + ".old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
            if keep_last is not None:
                _prune(os.path.dirname(os.path.abspath(path)), keep_last, keep=path)
        _barrier(model)
    except Exception as e:  # an asynchronous save reports its failure at the next wait()
        if errors is None:
            raise
        errors.append(f"{type(e).__name__}: {e}")


# -- discovery ----------------------------------------------------------------------------
def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under ``directory`` (None if none)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        if name.endswith((".partial", ".old")) or not is_complete(p):
            continue
        with open(os.path.join(p, MARKER)) as f:
            meta = json.load(f)
        step = (meta.get("extra") or {}).get("step")
        found.append((step if isinstance(step, (int, float)) else -1, meta.get("time", 0), p))
    return max(found)[2] if found else None


def _prune(directory: str, keep_last: int, keep: str) -> None:
    if keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last}: keep at least the newest checkpoint")
    complete = []
    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        if is_complete(p) and not name.endswith((".partial", ".old")):
            with open(os.path.join(p, MARKER)) as f:
                complete.append((json.load(f).get("time", 0), p))
    complete.sort()
    for _, p in complete[:-keep_last]:
        if os.path.abspath(p) != os.path.abspath(keep):
            try:
                # Un-commit first: a half-deleted directory must not look valid.
                os.remove(os.path.join(p, MARKER))
                shutil.rmtree(p)
            except OSError:
                pass


# -- load ---------------------------------------------------------------------------------
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


def _report(md, template: dict, with_optimizer: bool) -> LoadReport:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k: v for k, v in md.state_dict_metadata.items()
             if with_optimizer or not k.startswith(_state.OPT_PREFIX)}
    missing = sorted(k for k in template if k not in saved)
    unexpected = sorted(k for k in saved if k not in template)
    mism = []
    for k, t in template.items():
        m = saved.get(k)
        if isinstance(m, TensorStorageMetadata):
            if tuple(m.size) != tuple(t.shape) or m.properties.dtype != t.dtype:
                mism.append((k, tuple(m.size), tuple(t.shape), str(m.properties.dtype),
                             str(t.dtype)))
    return LoadReport(missing, unexpected, mism)


def load(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None, *,
         dataloader=None, strict: bool = True, trust_pickles: bool = False,
         restore_rng: bool = True, timeout: float = 300.0):
    """Load a checkpoint saved on any mesh into ``model`` (and the rest) laid out on this one.

    Returns ``(extra, report)``. ``strict`` raises ``CheckpointError`` naming each missing
    or unexpected key and each shape or dtype mismatch; ``strict=False`` loads what fits
    and returns the report. Pickled objects are refused unless ``trust_pickles``.
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path).rstrip("/")
    wait()
    _enter("load", path, model, timeout)
    if not is_complete(path):
        hint = " (an interrupted save: no commit marker)" if os.path.isdir(path) else ""
        raise CheckpointError(f"{path} is not a complete meshlab checkpoint{hint}; use "
                              f"meshlab.checkpoint.latest(dir) to find the newest valid one")
    with open(os.path.join(path, MARKER)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    reader = safe_reader(path, trust_pickles)
    md = reader.read_metadata()
    template = dict(_state.model_state(model))
    if optimizer is not None:
        _state.ensure_state(optimizer)
        opt_t, _ = _state.optimizer_state(optimizer, model)
        template.update(opt_t)
    report = _report(md, template, optimizer is not None)
    if not report.ok:
        if strict:
            mesh = meta.get("mesh")
            raise CheckpointError(f"{path} (saved on mesh {mesh}, {meta.get('world_size')} "
                                  f"ranks) does not fit:\n{report}")
        bad = set(report.missing) | {m[0] for m in report.mismatched}
        template = {k: v for k, v in template.items() if k not in bad}
    dcp.load(template, storage_reader=reader, process_group=_ctrl_group(model),
             no_dist=not _distributed())
    model_keys = {k: v for k, v in template.items() if not k.startswith(_state.OPT_PREFIX)}
    if strict:
        _state.set_model_state(model, model_keys)
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, StateDictOptions

        if _distributed() and getattr(model, "_meshlab", None) is not None:
            set_model_state_dict(model, model_keys, options=StateDictOptions(strict=False))
        else:
            model.load_state_dict(model_keys, strict=False)
    if optimizer is not None:
        _state.load_optimizer_state(optimizer, {k: v for k, v in template.items()
                                                if k.startswith(_state.OPT_PREFIX)},
                                    meta.get("optimizer", {}))
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(meta["scheduler"])
    if dataloader is not None and "dataloader" in meta:
        dataloader.load_state_dict(meta["dataloader"])
    if restore_rng:
        rf = os.path.join(path, f"rank-{_rank():05d}.json")
        if meta.get("world_size") == _world() and os.path.exists(rf):
            with open(rf) as f:
                _set_rng_state(json.load(f)["rng"])
    _barrier(model)
    return meta.get("extra"), report
