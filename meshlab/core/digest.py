"""Digests of what ranks must hold alike: a batch's tensors, a parameter's shard.

A tensor on the host is digested by hashing its bytes (BLAKE2b; no device work, nothing
a dispatch mode sees as a read). A tensor on a device is summed there instead, as two
64-bit integers over its bytes read as words: plain, and weighted by each word's
position, so a permutation (a transposed weight, two tokens swapped) differs in the
second; the arithmetic wraps, so the order of the additions cannot change them (NaNs
included, which a float sum would not), and the sums of many tensors are read back in
one transfer. Either way the same bytes give the same digest on every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import torch

from .tensors import local

_CHUNK = 1 << 22     # elements per pass (bounds the scratch memory of one tensor's sums)
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local data as a flat uint8 view (a contiguous copy where it is not)."""
    return local(t).detach().reshape(-1).contiguous().view(torch.uint8)


def _sums(t: torch.Tensor) -> torch.Tensor:
    """The two sums of ``t``'s local bytes, an int64 tensor of 2 on its device."""
    flat = local(t).detach().reshape(-1)
    word = _WORD.get(flat.element_size())
    w = flat.view(word) if word is not None else flat.view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=w.device)
    for i in range(0, w.numel(), _CHUNK):
        part = w[i:i + _CHUNK].to(torch.int64)
        pos = torch.arange(i + 1, i + 1 + part.numel(), dtype=torch.int64, device=w.device)
        out[0] += part.sum()
        out[1] += (part * pos).sum()
    return out


def digests(tensors: Iterable[torch.Tensor], *, device_reads: bool = True) -> list[str]:
    """A short hex digest of each tensor's local data, in order. Tensors on a device are
    read back (all of them in one transfer per device); ``device_reads=False`` leaves
    them unread, digested by their device alone (for a path that must not wait for one)."""
    tensors = list(tensors)
    out: list = [None] * len(tensors)
    on_device: dict = {}
    for i, t in enumerate(tensors):
        dev = local(t).device
        if dev.type == "cpu":
            out[i] = hashlib.blake2b(_bytes(t).numpy(), digest_size=8).hexdigest()
        elif device_reads:
            on_device.setdefault(dev, []).append(i)
        else:
            out[i] = f"unread on {dev}"
    for idx in on_device.values():
        sums = torch.stack([_sums(tensors[i]) for i in idx]).tolist()
        for i, (a, b) in zip(idx, sums):
            out[i] = f"{a & 0xffff_ffff:08x}{b & 0xffff_ffff_ffff:012x}"
    return out


def batch_digest(batch, *, device_reads: bool = True) -> Any:
    """What identifies a batch's contents: for each tensor (of a dict, list or tuple, or
    the batch itself) its shape, dtype and digest (``digests``); numbers, strings and None
    by ``repr``; any other object by its type. JSON-able."""
    tensors: list = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return ("tensor", len(tensors) - 1, list(v.shape), str(v.dtype))
        if isinstance(v, Mapping):
            return {str(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return repr(v)[:200]
        return type(v).__name__     # an object's repr may hold its address

    shape = walk(batch)
    found = digests(tensors, device_reads=device_reads)

    def fill(v):
        if isinstance(v, tuple) and v and v[0] == "tensor":
            return f"{v[2]} {v[3].removeprefix('torch.')} #{found[v[1]]}"
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fill(x) for x in v]
        return v

    return fill(shape)


_BATCH_FIX = ("tensor-, sequence- and pipeline-parallel peers compute one model on one "
              "batch: give them the same batch (meshlab.dataloader splits over the data axes "
              "only)")


def data_coords(rt) -> dict[str, int]:
    """This rank's coordinate on each data axis of a runtime (``roles.data``): the ranks
    with the same ones read one batch (the tensor, sequence and pipeline peers)."""
    return {a: rt.coordinate(a) for a in rt.roles.data}


def batch_entry(batch, coords: Mapping[str, int], name: str = "the batch", *,
                device_reads: bool = True) -> dict:
    """``agree``'s ``peers`` entry for ``batch``: equal among the ranks with the same
    ``coords`` on the data axes."""
    key = "ranks with " + ", ".join(f"{a}={c}" for a, c in coords.items()) if coords \
        else "every rank"
    return {name: (key, batch_digest(batch, device_reads=device_reads), _BATCH_FIX)}


def shard_key(p: torch.Tensor) -> str:
    """Which ranks hold the same local data as this rank for ``p``: its coordinate on each
    mesh dimension a DTensor is split over (``'tp=1'``); ``'replicated'`` for a plain
    tensor or a DTensor replicated everywhere."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return "replicated"
    mesh = p.device_mesh
    coord = mesh.get_coordinate() or []
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    split = [f"{n}={c}" for n, c, pl in zip(names, coord, p.placements)
             if not pl.is_replicate()]
    return ", ".join(split) or "replicated"


def replica_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, str]]:
    """For ``agree``'s ``peers``: each parameter's name -> (which ranks hold the same shard
    of it, the digest of this rank's)."""
    named = list(named)
    return {n: (shard_key(p), d) for (n, p), d in zip(named, digests(p for _, p in named))}
