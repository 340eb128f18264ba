"""Sharded, atomic, optionally asynchronous checkpoints over torch.distributed.checkpoint.

A checkpoint is a directory. Every rank writes only its shards (DCP) and
``rank-XXXXX.json`` (its RNG states and the SHA-256 of its shards); rank 0 writes, last,
``meshlab.json``: the commit marker, holding everything that is not a tensor (optimizer
hyper-parameters, loss scaler, scheduler, data position, user ``extra``) and the size
and checksum of every file. The directory is written as ``<path>.partial`` and moved
into place by rank 0 only after every rank finished (``_commit``: an existing checkpoint
is set aside as ``<path>.old`` and deleted only after the new one is in place), so a
crash at any moment leaves the old state or the new one, and ``latest``/``load`` find it.

Each phase ends with every rank agreeing (``_ranks.agree``): a rank that fails alone —
a full disk, say — makes every rank raise a ``CheckpointError`` naming it, and what the
failed save wrote is removed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from typing import Any

import torch
from torch import nn

from . import _fourbit
from . import _rng
from . import _state
from ._commit import base_names, commit, discard, recover, resolve, write_json
from ._files import (FORMAT, MARKER, checked, entry, is_complete, order_key, rank_file, seal,
                     shard_prefix, unhealthy)
from ._inflight import IN_FLIGHT, Pending, background_group, wait
from ._load import LoadReport as LoadReport, load as load
from ._progress import bar, save_planner, shown
from ._ranks import agree, as_error, ctrl_group, distributed, enter, rank, world
from ._safe import CheckpointError
from ..core.log import get_logger
from ..transforms._install import runtime_or_none


def _fault(point: str) -> None:
    """Fault injection for the reliability tests: MESHLAB_FAULT=<point>:<rank> kills that
    rank with SIGKILL when it reaches ``point``."""
    spec = os.environ.get("MESHLAB_FAULT")
    if spec and spec == f"{point}:{rank()}":
        os.kill(os.getpid(), signal.SIGKILL)


# -- save ---------------------------------------------------------------------------------
def save(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None,
         extra: dict | None = None, *, dataloader=None, overwrite: bool = False,
         keep_last: int | None = None, async_save: bool = False,
         timeout: float = 300.0, weights: bool = True) -> str:
    """Save a sharded checkpoint into directory ``path``; every rank calls it.

    ``extra`` (a dict of JSON values) is for the user's own state (``{'step': 100}``).
    ``async_save`` copies the state to CPU before returning (from an accelerator into
    pinned buffers kept for the next save, ``_stage``) and writes it in the background
    (at most one save in flight: a new save first waits for the last).
    ``keep_last=k`` deletes older complete checkpoints next to ``path``, never the newest
    valid one. A save before the optimizer's first step records that it has no state yet
    (it creates none, so the run goes on exactly as without the save).
    ``weights=False`` leaves the model's tensors out (an optimizer-only checkpoint; the
    model still names the optimizer's parameters); ``load(..., weights=False)`` reads it.
    The marker records the step's health where the save knows it: ``extra['loss']`` and
    the optimizer's last gradient norm (``meshlab.optimizer`` with clipping or
    ``nonfinite``); ``latest`` passes over a checkpoint whose loss or norm is not finite.
    A synchronous save shows the tensors rank 0 writes as a progress bar
    (``MESHLAB_PROGRESS``, ``core.progress``); an asynchronous one writes without a bar.
    """
    path = os.fspath(path).rstrip("/")
    show = not async_save and shown()     # MESHLAB_PROGRESS checked alike on every rank
    wait()
    enter("save", path, model, timeout)
    group, tmp = ctrl_group(model), path + ".partial"
    meta = _start(path, tmp, model, scheduler, extra, dataloader, overwrite, keep_last, group)
    try:                               # collective (ZeRO-1 assembles the optimizer state)
        tensors = dict(_state.model_state(model)) if weights else {}
        meta["weights"] = weights
        if optimizer is not None:
            opt_t, rest = _state.optimizer_state(optimizer, model)
            tensors.update(opt_t)
            meta["optimizer"] = {**rest, "has_state": _state.has_state(optimizer)}
        meta["health"] = _health(extra, optimizer)
    except BaseException:
        _discard_quietly(tmp)
        raise
    rng = _rng.capture()
    if not async_save:
        t0 = time.perf_counter()
        _finish(tensors, meta, rng, path, tmp, keep_last, group, None, None, show, timeout)
        get_logger("meshlab.checkpoint").info("saved %s (%d tensors) in %.1f s", path,
                                              len(tensors), time.perf_counter() - t0)
        return path
    # Stage: copy every local shard now, so later updates cannot reach the file.
    staged = _stage(tensors)
    errors: list = []
    bg = background_group(model)
    thread = threading.Thread(target=_finish, name="meshlab-save",
                              args=(staged, meta, rng, path, tmp, keep_last, bg, bg, errors,
                                    False, timeout))
    IN_FLIGHT.append(Pending(thread, errors))
    thread.start()
    return path


def _start(path, tmp, model, scheduler, extra, dataloader, overwrite, keep_last,
           group) -> dict:
    """Checks, then rank 0's recovery of a crashed earlier save and the new ``.partial``;
    every rank agrees after each (nothing is written before the first)."""
    err, meta = None, None
    exists = resolve(path, is_complete) is not None    # before rank 0 changes anything
    try:
        _state.check_extra(extra)
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least the newest checkpoint")
        if exists and not overwrite:
            raise CheckpointError(f"{path} already holds a checkpoint; pass overwrite=True to "
                                  f"replace it, or save to a new step directory")
        meta = _meta(model, scheduler, extra, dataloader)
    except Exception as e:          # whatever one rank hits, every rank raises
        err = as_error(e, "save", path)
    agree(group, "checkpoint.save: check", {"existing checkpoint": exists}, err)
    err = None
    if rank() == 0:
        try:
            recover(path, is_complete)
            os.makedirs(tmp)
        except OSError as e:
            err = as_error(e, "save", path)
    _agree_or_discard(group, "checkpoint.save: start", tmp, err)
    return meta


def _meta(model, scheduler, extra, dataloader) -> dict:
    meta: dict[str, Any] = {"format": FORMAT, "world_size": world(), "time": time.time()}
    rt = runtime_or_none(model)
    if rt is not None:
        meta["mesh"] = dict(rt.mesh.shape)
        meta["transforms"] = list(rt.plan.transforms)
    if scheduler is not None:
        meta["scheduler"] = _state._jsonable(scheduler.state_dict(), "scheduler.state_dict()")
    if dataloader is not None:
        meta["dataloader"] = _state._jsonable(dataloader.state_dict(), "dataloader.state_dict()")
    if extra is not None:
        meta["extra"] = extra
    quantized = _fourbit.record(model)      # a 4-bit base's quantization, checked at load
    if quantized:
        meta["quantized"] = quantized
    return meta


def _health(extra, optimizer) -> dict:
    """What the save knows of the step it follows: the loss the caller recorded in
    ``extra['loss']`` and the optimizer's last global gradient norm (None where unknown)."""
    def number(v):
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    return {"loss": number((extra or {}).get("loss")),
            "grad_norm": number(getattr(optimizer, "last_grad_norm", None))}


_PINNED: dict = {}     # name -> the pinned host buffer its last asynchronous save used


def _stage(tensors: dict) -> dict:
    """Every local shard copied to host memory now, so later updates cannot reach the file.

    From an accelerator: into pinned buffers kept per name for the next save (``wait()``
    has finished the last write before a save stages again), by non-blocking copies and
    one synchronization. Measured on an H100 for a 3.5 GiB state: 68 ms, against 2,832 ms
    copying each tensor into pageable memory (what this did before) and 1,507 ms for the
    first call of DCP's ``DefaultStager``, whose second call raises ``KeyError: <class
    'type'>`` on torch 2.11 (``benchmarks/stage_gpu.py``,
    ``benchmarks/results/stage_nvidia_h100_80gb_hbm3.json``); the buffers stay allocated
    for the process, as DCP's stager keeps its own. From the CPU: plain copies."""
    from torch.distributed.tensor import DTensor

    for name in set(_PINNED) - set(tensors):
        del _PINNED[name]
    out, pending = {}, False
    for name, t in tensors.items():
        local = (t.to_local() if isinstance(t, DTensor) else t).detach()
        if local.device.type == "cpu":
            copy = local.to("cpu", copy=True)
        else:
            copy = _PINNED.get(name)
            if copy is None or copy.shape != local.shape or copy.dtype != local.dtype:
                copy = _PINNED[name] = torch.empty(local.shape, dtype=local.dtype,
                                                   pin_memory=True)
            copy.copy_(local, non_blocking=True)
            pending = True
        out[name] = DTensor.from_local(copy, t.device_mesh, t.placements, run_check=False,
                                       shape=t.shape, stride=t.stride()) \
            if isinstance(t, DTensor) else copy
    if pending:
        torch.accelerator.synchronize()
    return out


def _discard_quietly(tmp: str) -> None:
    """Rank 0 removes what a failed save wrote (the others have stopped writing)."""
    if rank() != 0:
        return
    try:
        discard(tmp)
    except OSError as e:
        warnings.warn(f"could not remove {tmp} after the failed save ({e}); the next save "
                      f"to this path removes it", stacklevel=3)


def _agree_or_discard(group, what: str, tmp: str, err, timeout: float | None = None) -> None:
    try:
        agree(group, what, error=err, timeout=timeout)
    except BaseException:
        _discard_quietly(tmp)
        raise


def _finish(tensors, meta, rng, path, tmp, keep_last, group, dcp_group, errors,
            show: bool = False, timeout: float | None = None) -> None:
    """Write (every rank), agree, commit (rank 0), agree. ``errors`` collects the failure
    of an asynchronous save for ``wait()``; ``show``: a bar counts the tensors written.
    ``timeout``: how long a rank that has written waits for the others in each agreement
    (a rank that died writing fails every other rank after it, never leaves one waiting)."""
    from torch.distributed.checkpoint.api import CheckpointException
    import torch.distributed.checkpoint as dcp

    try:
        err = None
        try:
            with bar(None, "save", unit="tensor", on=show) as b:
                dcp.save(tensors, checkpoint_id=tmp, process_group=dcp_group,
                         no_dist=not distributed(), planner=save_planner(b))
            _fault("after_write")
            _write_rank_file(tmp, rng)
        except (Exception, CheckpointException) as e:   # torch's is a BaseException
            err = as_error(e, "save", path, where=f"its shards into {tmp}")
        _agree_or_discard(group, "checkpoint.save: write", tmp, err, timeout)
        err = None
        if rank() == 0:
            try:
                _commit(tmp, path, meta)
            except Exception as e:  # the others wait in the agreement below
                err = as_error(e, "save", path)
                _undo(path)
            else:
                _prune(os.path.dirname(os.path.abspath(path)), keep_last, keep=path)
        agree(group, "checkpoint.save: commit", error=err, timeout=timeout)
    except Exception as e:  # an asynchronous save reports its failure at the next wait()
        if errors is None:
            raise
        errors.append(e)


def _write_rank_file(tmp: str, rng: dict) -> None:
    """This rank's RNG states and the size and SHA-256 of each shard it wrote."""
    mine = {n: entry(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))
            if n.startswith(shard_prefix(rank())) and n.endswith(".distcp")}
    write_json(os.path.join(tmp, rank_file(rank())), {"rng": rng, "files": mine})


def _commit(tmp: str, path: str, meta: dict) -> None:
    """Rank 0: list every file with its checksum in the marker, write it, move the
    directory into place."""
    import json

    files: dict = {}
    for r in range(world()):
        with open(os.path.join(tmp, rank_file(r))) as f:
            files.update(json.load(f)["files"])
    for n in sorted(os.listdir(tmp)):
        if n not in files and n != MARKER and not n.endswith(".tmp"):
            files[n] = entry(os.path.join(tmp, n))
    write_json(os.path.join(tmp, MARKER), seal({**meta, "files": files}))
    _fault("before_rename")
    commit(tmp, path)


def _undo(path: str) -> None:
    """Rank 0, after a failed commit: back to the committed state, leftovers removed."""
    try:
        recover(path, is_complete)
    except OSError as e:
        warnings.warn(f"could not tidy {path} after the failed save ({e}); the next save "
                      f"to this path does", stacklevel=3)


# -- discovery ----------------------------------------------------------------------------
def _committed(directory: str) -> list[tuple[tuple, str, str | None]]:
    """(order key, directory, why it is unhealthy or None) of every committed checkpoint
    with a readable marker under ``directory``, oldest first; damaged ones are skipped
    with a warning."""
    found = []
    for name in base_names(directory):
        d = resolve(os.path.join(directory, name), is_complete)
        meta = checked(d) if d is not None else None
        if meta is not None:
            found.append((order_key(meta), d, unhealthy(meta)))
    return sorted(found, key=lambda x: x[:2])


def latest(directory: str | os.PathLike) -> str | None:
    """The newest committed checkpoint directly under ``directory`` that training can
    resume from (None if none): highest ``extra['step']``, then newest. After a crash
    mid-overwrite that may be ``<name>.old``. Skipped with a warning that names them: a
    checkpoint whose marker is damaged, and one whose recorded loss, gradient norm or step
    is not finite (a diverged step; ``load`` still reads it by name)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    for _, d, why in reversed(_committed(directory)):
        if why is None:
            return d
        warnings.warn(f"skipping {d}: {why}, so training cannot resume from it; load it "
                      f"by name to inspect it", stacklevel=2)
    return None


def _prune(directory: str, keep_last: int | None, keep: str) -> None:
    """Rank 0, after a commit: delete all but the newest ``keep_last`` checkpoints (in
    ``latest``'s order), never ``keep``. The save has succeeded: failures only warn."""
    if keep_last is None:
        return
    try:
        found = _committed(directory)
        # the newest one training can resume from stays, however many diverged after it
        resumable = next((d for _, d, why in reversed(found) if why is None), None)
        kept = {os.path.abspath(keep), os.path.abspath(resumable or keep)}
        for _, p, _why in found[:-keep_last]:
            if os.path.abspath(p) not in kept:
                discard(p)
    except OSError as e:
        warnings.warn(f"keep_last={keep_last}: could not delete old checkpoints in "
                      f"{directory} ({e}); the next save tries again", stacklevel=4)


__all__ = ["save", "load", "latest", "wait", "is_complete", "LoadReport", "MARKER"]
