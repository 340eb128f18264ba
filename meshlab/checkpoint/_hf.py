"""Hugging Face checkpoints: ``save_pretrained`` writes what ``from_pretrained`` reads;
``load_pretrained`` streams safetensors into a sharded model, slice by slice.

Export gathers one parameter at a time (every rank takes part; rank 0 writes), so the
whole model is never in one process; tied names are written once, as Hugging Face does.
Import opens each safetensors file lazily: every rank reads only the block of each
parameter it owns (parameters with strided layouts — a packed q|k|v split by tensor
parallelism — are read whole, one at a time). No pickle is involved either way.

An export carries a checksum manifest (``_manifest``) that the import verifies before it
reads a weight (an export without one, written by transformers, is read as it is). Names
meet through peft's renaming (``_names``): a base model's export loads into the base
weights of a model with LoRA adapters.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import torch
from torch import nn

from . import _fourbit, _manifest, _names
from ._commit import commit, discard, recover, resolve
from ._load import LoadReport, held_anywhere
from ._progress import bar, byte_bar, shown
from ._ranks import agree, as_error, ctrl_group, distributed, enter, rank, world
from ._safe import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

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
    """Parameters (first name of tied ones) and persistent buffers, in model order; a
    4-bit weight (``lora(quantize=...)``) as its packed bytes and each tensor of its quant
    state, the model's own (``_fourbit.live``), in place of bitsandbytes' keys."""
    four = _fourbit.weights(model)
    out = []
    for n, p in model.named_parameters():
        out += list(_fourbit.live(n, p).items()) if n in four else [(n, p)]
    names = {n for n, _ in out}
    for n, b in model.state_dict().items():
        if any(n.startswith(w + ".") for w in four):
            continue                  # bitsandbytes' keys: ``live`` holds their tensors
        if n not in names and not any(n == x for x, _ in model.named_parameters(remove_duplicate=False)):
            if not isinstance(b, nn.Parameter):
                out.append((n, b))
    return out


def exported(path: str) -> bool:
    """Whether directory ``path`` holds a finished export (its weights or their index)."""
    return os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))


class _Meta:
    """A tensor's global shape and dtype, as ``_plan`` and the receiving rank need them."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _owners(items: list, group) -> tuple[dict[str, int], list[tuple[str, _Meta]]]:
    """Every tensor of the whole model (under a pipeline each rank holds its stages' only),
    in stage order, and the lowest rank holding each: that rank sends it to rank 0."""
    mine = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in items]
    if not distributed():
        return {n: 0 for n, _ in items}, [(n, _Meta(s, getattr(torch, d))) for n, s, d in mine]
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=group)
    owners: dict[str, int] = {}
    metas = []
    for r, listing in enumerate(every):
        for n, s, d in listing:
            if n not in owners:
                owners[n] = dist.get_global_rank(group, r) if group is not None else r
                metas.append((n, _Meta(s, getattr(torch, d))))
    return owners, metas


def _plan(items: list, limit: int) -> tuple[list[list[str]], dict[str, int]]:
    """Shard assignment from shapes alone: no communication needed to plan the files."""
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
    return shards, sizes


def save_pretrained(directory: str | os.PathLike, model: nn.Module, *,
                    max_shard_size: int | str = "5GB", timeout: float = 300.0,
                    extra: dict | None = None) -> str:
    """Write ``config.json``, safetensors shards and ``model.safetensors.index.json``,
    and the checksum manifest ``meshlab.manifest.json`` (with ``extra``, a dict of JSON
    values such as ``{'step': 100}``; ``exported_extra`` reads it back).

    The export is written into ``<directory>.partial`` and replaces ``directory``
    atomically (the old export is set aside as ``<directory>.old`` until the new one is in
    place), so a crash at any point leaves the old export or the new one, which
    ``load_pretrained`` finds. A failure on any rank (a full disk) raises a
    ``CheckpointError`` on every rank and removes what was written.
    """
    from ._state import check_extra

    check_extra(extra)
    return export_tensors(directory, model, _tensors(model), max_shard_size=max_shard_size,
                          timeout=timeout, extra=extra)


def export_tensors(directory, model: nn.Module, items: list, *, max_shard_size="5GB",
                   timeout: float = 300.0, extra: dict | None = None, transform=None,
                   what: str = "save_pretrained") -> str:
    """``save_pretrained``'s export of ``items`` (``[(name in the file, tensor)]``, every
    rank its own; ``transform(name, whole tensor)`` on rank 0 before it is written). Rank 0
    shows the bytes written as a progress bar (``MESHLAB_PROGRESS``, ``core.progress``)."""
    directory = os.fspath(directory).rstrip("/")
    show = shown()                       # MESHLAB_PROGRESS checked alike on every rank
    enter(what, directory, model, timeout)
    group, tmp, err = ctrl_group(model), directory + ".partial", None
    quantized = None
    try:                     # a 4-bit base's quantization, recorded in the manifest
        quantized = _fourbit.record(model) or None
    except CheckpointError as e:
        err = as_error(e, what, directory)
    agree(group, f"checkpoint.{what}: check", error=err)
    owners, metas = _owners(items, group)
    shards, sizes = _plan(metas, _parse_size(max_shard_size))
    if rank() == 0:
        try:
            recover(directory, exported)
            os.makedirs(tmp)
        except OSError as e:
            err = as_error(e, what, directory)
    _agree_or_discard(group, f"checkpoint.{what}: start", tmp, err)
    desc = "export merged" if what == "save_merged" else "export"
    with byte_bar(sum(sizes.values()), desc, on=show) as b:
        weight_map, err = _write_shards(dict(items), shards, tmp, directory, owners,
                                        dict(metas), group, transform,
                                        done=lambda n: b.update(sizes[n]))
    if rank() == 0 and err is None:
        try:
            _finish_export(model, tmp, directory, weight_map, sum(sizes.values()),
                           len(shards), extra, quantized)
        except Exception as e:      # the others wait in the agreement below
            err = as_error(e, what, directory)
            try:
                recover(directory, exported)
            except OSError:
                pass                    # the next export tidies it
    _agree_or_discard(group, f"checkpoint.{what}: commit", tmp, err)
    return directory


def _agree_or_discard(group, what: str, tmp: str, err) -> None:
    try:
        agree(group, what, error=err)
    except BaseException:
        if rank() == 0 and os.path.lexists(tmp):
            discard(tmp)
        raise


def _write_shards(lookup: dict, shards: list[list[str]], tmp: str, directory: str,
                  owners: dict, metas: dict, group, transform=None, done=None):
    """The ranks holding each tensor gather it in turn (a pipeline stage's tensors only
    on that stage's ranks) and the lowest of them sends it to rank 0, which writes it into
    its file at once (``_stream``: the file's header is written first), so rank 0 holds
    one tensor at a time. ``transform(name, full)`` turns a gathered tensor into the one
    written (on rank 0; ``save_merged`` merges adapters there). A write that fails stops
    the writing but not the gathering, so no rank is left waiting. ``done(name)`` follows
    each tensor, written or not (the progress bar's count)."""
    import torch.distributed as dist

    from ._stream import StreamWriter

    total = len(shards)
    weight_map, err = {}, None
    me = rank()
    for i, names in enumerate(shards):
        name = SINGLE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        writer = None
        if me == 0 and err is None:
            try:
                writer = StreamWriter(os.path.join(tmp, name),
                                      [(n, metas[n].shape, metas[n].dtype) for n in names],
                                      {"format": "pt"})
            except Exception as e:
                err = _write_error(e, directory, tmp, name)
        for n in names:
            weight_map[n] = name
            full = _gather_to_zero(n, lookup.get(n), owners[n], metas[n], group, me)
            if writer is not None and err is None:
                try:
                    writer.write(n, transform(n, full) if transform is not None else full)
                except Exception as e:
                    err = _write_error(e, directory, tmp, name)
            del full
            if done is not None:
                done(n)
        if writer is not None and err is None:
            try:
                writer.close()
            except Exception as e:
                err = _write_error(e, directory, tmp, name)
    return weight_map, err


def _gather_to_zero(n: str, t, owner: int, meta, group, me: int):
    """Tensor ``n`` whole on rank 0 (every holder joins the gather; the lowest holder
    sends it to rank 0 when rank 0 holds none of it); None elsewhere."""
    import torch.distributed as dist

    full = None
    if t is not None:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if me in (0, owner):
            full = full.detach().to("cpu").contiguous()
    if owner != 0 and me == owner:
        dist.send(full, dst=0, group=group)
    elif owner != 0 and me == 0:
        full = torch.empty(meta.shape, dtype=meta.dtype)
        dist.recv(full, src=owner, group=group)
    return full if me == 0 else None


def _write_error(e: Exception, directory: str, tmp: str, name: str):
    if not isinstance(e, OSError):   # safetensors reports the OS error code in its text
        code = re.search(r"code: (\d+)", str(e))
        e = OSError(int(code.group(1)) if code else None, str(e), os.path.join(tmp, name))
    return as_error(e, "save_pretrained", directory)


def _finish_export(model, tmp: str, directory: str, weight_map: dict, total_size: int,
                   files: int, extra: dict | None = None, quantized: dict | None = None
                   ) -> None:
    """Rank 0: the index, config and manifest, then the atomic replacement."""
    from ._commit import fsync_dir

    if files > 1:
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                      f, indent=2)
            f.flush()
            os.fsync(f.fileno())
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg.save_pretrained(tmp)
    _manifest.write(tmp, extra, quantized)
    fsync_dir(tmp)
    commit(tmp, directory)


def exported_extra(directory: str | os.PathLike) -> dict | None:
    """The ``extra`` an export was written with (None for an export without one)."""
    d = os.fspath(directory).rstrip("/")
    doc = _manifest.read(resolve(d, exported) or d)
    return doc.get("extra") if doc is not None else None


def _index(directory: str, manifest: dict | None = None) -> dict[str, str]:
    """Tensor name -> the file that holds it (each a file the manifest lists)."""
    wmap = _weight_map(directory)
    for name in sorted(set(wmap.values()) | ({INDEX} if os.path.exists(
            os.path.join(directory, INDEX)) else set())):
        _manifest.listed(manifest, directory, name)
    return wmap


def _weight_map(directory: str) -> dict[str, str]:
    idx = os.path.join(directory, INDEX)
    if os.path.exists(idx):
        try:
            with open(idx, "rb") as f:
                wmap = json.loads(f.read().decode())["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx} is damaged ({type(e).__name__}: {e}); export the "
                                  f"model again") from None
        if not isinstance(wmap, dict) or not all(
                isinstance(v, str) and os.path.basename(v) == v and v not in ("", ".", "..")
                for v in wmap.values()):
            raise CheckpointError(f"{idx}: its weight_map must name files inside {directory}; "
                                  f"meshlab refuses to read others")
        return wmap
    single = os.path.join(directory, SINGLE)
    if os.path.exists(single):
        with _open_safetensors(single) as f:
            return {k: SINGLE for k in f.keys()}
    raise CheckpointError(f"{directory} has neither {SINGLE} nor {INDEX} (meshlab reads "
                          f"safetensors only); export it with save_pretrained, or pass the "
                          f"directory that holds them")


def _open_safetensors(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as e:        # missing, truncated or garbage header
        what = "missing" if not os.path.exists(path) else "damaged"
        raise CheckpointError(f"{path} is {what} ({type(e).__name__}: {e}); export the model "
                              f"again") from None


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
    """Stream a Hugging Face safetensors checkpoint into ``model`` (sharded or not).

    Every name, shape and file is checked on every rank before any weight is written
    (pipeline stages check the names they hold; a name is unexpected only when no stage
    holds it); a failure on one rank raises a ``CheckpointError`` on every rank. After a
    crash mid-export, the export that was committed is read (``<directory>.old``).

    Every file is checked against the export's manifest first (the ranks share the
    hashing). A LoRA model takes a base model's export into its base weights (peft's
    names, ``_names``; the adapters keep their values), and a file whose names match
    none of the model's weights raises ``CheckpointNamingError`` even with
    ``strict=False``. Rank 0 shows the tensors it copies in as a progress bar
    (``MESHLAB_PROGRESS``, ``core.progress``)."""
    directory = os.fspath(directory).rstrip("/")
    show = shown()                       # MESHLAB_PROGRESS checked alike on every rank
    enter("load_pretrained", directory, model, timeout)
    group, err, handles = ctrl_group(model), None, {}
    d = resolve(directory, exported) or directory
    items = _tensors(model)
    try:
        report, slices = None, {}
        try:
            report, slices = _check_import(d, model, items, handles, group)
            if strict and not report.ok:
                raise CheckpointError(f"{d} does not fit {type(model).__name__}:\n{report}")
        except Exception as e:
            err = as_error(e, "load_pretrained", d)
        agree(group, "checkpoint.load_pretrained: check", error=err)
        try:
            from . import _state

            # A parameter whose value lives in a part's master (offload's fp32 copy of a
            # bf16 device tensor) is read into the master; then every master copy (ZeRO-1's
            # slices, offload's host masters) is made to agree with the loaded weights.
            masters = _state._masters(model)
            with bar(len(slices), "load", unit="tensor", on=show) as b:
                _copy_in([(n, masters.get(n, t)) for n, t in items], slices, b.update)
            _state.refresh_masters(model)
        except Exception as e:
            err = as_error(e, "load_pretrained", d)
        agree(group, "checkpoint.load_pretrained: read", error=err)
    finally:
        for f in handles.values():
            f.__exit__(None, None, None)
    return report


def _share(group) -> tuple[int, int]:
    """(this rank, ranks) of the group that splits the hashing of an export's files."""
    import torch.distributed as dist

    if group is not None and distributed():
        return dist.get_rank(group), dist.get_world_size(group)
    return rank(), world()


def _check_import(d: str, model: nn.Module, items: list, handles: dict, group):
    """The report, and the open slice of every parameter that fits. The exchange of which
    names some rank holds runs on every rank, even one whose files failed to open."""
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    wmap, err, doc = {}, None, None
    try:
        doc = _manifest.check(d, _share(group))
        wmap = _index(d, doc)
    except CheckpointError as e:
        err = e
    keys = sorted(wmap) if err is None else []
    agree(group, "checkpoint.load_pretrained: index",
          {"names": hashlib.sha256("\n".join(keys).encode()).hexdigest()}, err)
    # tied aliases load through the first name; peft's names meet the file's (_names)
    al = _names.align([n for n, _ in items], keys, aliases=all_names)
    flags = held_anywhere(keys, al.used, group)
    unexpected = [k for k, h in zip(keys, flags) if not h]
    _names.check(al, unexpected, d)
    mism, slices = [], {}
    for n, t in items:
        key = al.source.get(n)
        if key is None:
            continue
        if wmap[key] not in handles:
            handles[wmap[key]] = _open_safetensors(os.path.join(d, wmap[key])).__enter__()
        try:
            sl = handles[wmap[key]].get_slice(key)
        except Exception as e:
            raise CheckpointError(f"{os.path.join(d, wmap[key])} does not hold {key}, though "
                                  f"the index says so ({e}); export the model again") from None
        saved = tuple(sl.get_shape())
        if saved != tuple(t.shape):
            mism.append((n, saved, tuple(t.shape), str(sl.get_dtype()), str(t.dtype)))
            continue
        slices[n] = (sl, handles[wmap[key]], key)
    # a 4-bit weight loads whole, from one quantized as the model's (the manifest's record)
    _fourbit.check((doc or {}).get("quantized"), model, al.source, d)
    return LoadReport(al.missing, unexpected, mism), slices


def _copy_in(items: list, slices: dict, advance=None) -> None:
    """Each rank copies its block of every parameter that fits (no communication);
    ``advance(1)`` after each."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for n, t in items:
            if n not in slices:
                continue
            sl, f, key = slices[n]
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
                t.copy_(sl[:] if t.dim() else f.get_tensor(key))
            if advance is not None:
                advance(1)
