"""Hugging Face checkpoints: ``save_pretrained`` writes what ``from_pretrained`` reads;
``load_pretrained`` streams safetensors into a sharded model, slice by slice.

Export gathers one parameter at a time (every rank takes part; rank 0 writes), so the
whole model is never in one process; tied names are written once, as Hugging Face does.
Import opens each safetensors file lazily: every rank reads only the block of each
parameter it owns (parameters with strided layouts — a packed q|k|v split by tensor
parallelism — are read whole, one at a time). No pickle is involved either way.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

from ._dcp import LoadReport, _barrier, _distributed, _enter, _fsync_dir, _rank
from ._safe import CheckpointError

_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}


def _parse_size(s: int | str) -> int:
    if isinstance(s, int):
        return s
    t = s.strip().upper()
    for u, m in sorted(_UNITS.items(), key=lambda x: -len(x[0])):
        if t.endswith(u):
            return int(float(t[:-len(u)]) * m)
    return int(t)


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (first name of tied ones) and persistent buffers, in model order."""
    out = list(model.named_parameters())
    names = {n for n, _ in out}
    for n, b in model.state_dict().items():
        if n not in names and not any(n == x for x, _ in model.named_parameters(remove_duplicate=False)):
            if not isinstance(b, nn.Parameter):
                out.append((n, b))
    return out


def save_pretrained(directory: str | os.PathLike, model: nn.Module, *,
                    max_shard_size: int | str = "5GB", timeout: float = 300.0) -> str:
    """Write ``config.json``, safetensors shards and ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    directory = os.fspath(directory).rstrip("/")
    _enter("save_pretrained", directory, model, timeout)
    limit = _parse_size(max_shard_size)
    items = _tensors(model)
    # Shard assignment from shapes alone: no communication needed to plan the files.
    shards: list[list[str]] = [[]]
    size = 0
    sizes = {}
    for n, t in items:
        b = math.prod(t.shape) * t.element_size()
        sizes[n] = b
        if shards[-1] and size + b > limit:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    total = len(shards)
    fname = (lambda i: "model.safetensors") if total == 1 else \
        (lambda i: f"model-{i + 1:05d}-of-{total:05d}.safetensors")
    tmp = directory + ".partial"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(model)
    lookup = dict(items)
    weight_map = {}
    for i, names in enumerate(shards):
        buf = {}
        for n in names:
            t = lookup[n]
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            if _rank() == 0:
                buf[n] = full.detach().to("cpu").contiguous().clone()
            weight_map[n] = fname(i)
        if _rank() == 0:
            save_file(buf, os.path.join(tmp, fname(i)), metadata={"format": "pt"})
        del buf
    if _rank() == 0:
        if total > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": sum(sizes.values())},
                           "weight_map": weight_map}, f, indent=2)
        cfg = getattr(model, "config", None)
        if cfg is not None:
            cfg.save_pretrained(tmp)
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.replace(tmp, directory)
        _fsync_dir(os.path.dirname(os.path.abspath(directory)))
    _barrier(model)
    return directory


def _index(directory: str) -> dict[str, str]:
    idx = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise CheckpointError(f"{directory} has neither model.safetensors nor "
                          f"model.safetensors.index.json (meshlab reads safetensors only)")


def _block(t) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, global offset) when this rank's part of DTensor ``t`` is one block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in t.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def load_pretrained(directory: str | os.PathLike, model: nn.Module, *, strict: bool = True,
                    timeout: float = 300.0) -> LoadReport:
    """Stream a Hugging Face safetensors checkpoint into ``model`` (sharded or not)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    directory = os.fspath(directory).rstrip("/")
    _enter("load_pretrained", directory, model, timeout)
    wmap = _index(directory)
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    items = _tensors(model)
    first = {n for n, _ in items}
    aliases = [n for n in all_names if n not in first]        # tied: loaded through the first
    missing = [n for n, _ in items if n not in wmap]
    unexpected = [k for k in wmap if k not in first and k not in aliases]
    mism = []
    handles: dict[str, object] = {}
    try:
        for n, t in items:
            if n not in wmap:
                continue
            f = handles.get(wmap[n])
            if f is None:
                f = handles[wmap[n]] = safe_open(os.path.join(directory, wmap[n]),
                                                 framework="pt").__enter__()
            sl = f.get_slice(n)
            saved = tuple(sl.get_shape())
            if saved != tuple(t.shape):
                mism.append((n, saved, tuple(t.shape), str(sl.get_dtype()), str(t.dtype)))
                continue
            with torch.no_grad():
                if isinstance(t, DTensor):
                    blk = _block(t)
                    if blk is not None:
                        shape, off = blk
                        idx = tuple(slice(o, o + s) for o, s in zip(off, shape))
                        t.to_local().copy_(sl[idx] if idx else sl[:])
                    else:
                        full = sl[:].to(t.dtype)
                        local = distribute_tensor(full, t.device_mesh, t.placements,
                                                  src_data_rank=None).to_local()
                        t.to_local().copy_(local)
                else:
                    t.copy_(sl[:] if t.dim() else f.get_tensor(n))
    finally:
        for f in handles.values():
            f.__exit__(None, None, None)
    report = LoadReport(missing, unexpected, mism)
    if strict and not report.ok:
        raise CheckpointError(f"{directory} does not fit {type(model).__name__}:\n{report}")
    _barrier(model)
    return report
