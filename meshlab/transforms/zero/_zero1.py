"""ZeRO-1's flat buffers: one per (dtype, tensor-parallel sharding) bucket of parameters,
each data-parallel rank owning a contiguous slice that its optimizer updates in fp32.

The optimizer runs them through ``Zero1Part`` (``sync``, ``gather``); checkpoints save
and load their state through the same part's ``Part`` hooks (``full_state``,
``slice_state``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ...core.collectives import all_gather_into, reduce_scatter_into
from ...core.tensors import local as _local, shard_groups


class Bucket(NamedTuple):
    """Parameters flattened into one buffer: their local sizes, the per-rank slice length
    and the groups their local data is sharded over (tensor parallel)."""

    params: list
    numels: list[int]
    per: int
    groups: tuple


class Zero1Buffers:
    """The buckets and this rank's master slices (``shards``, fp32 parameters)."""

    def __init__(self, params: list, group, size: int, apart: frozenset = frozenset(),
                 group_of: dict | None = None, reduce: torch.dtype | None = None):
        # ``apart``: ids of parameters bucketed on their own (offload moves their slices to
        # the host; a slice may then live on another device than the parameters).
        # ``group_of``: id -> the optimizer's parameter group; a bucket holds one group's.
        group_of = group_of or {}
        self.group, self.size, self.rank = group, size, dist.get_rank(group)
        self.reduce = reduce        # the dtype gradients are reduce-scattered in (None: fp32)
        self.device = _local(params[0]).device if params else None
        by_key: dict = {}
        for p in params:
            key = (p.dtype, shard_groups(p), id(p) in apart, group_of.get(id(p), 0))
            by_key.setdefault(key, []).append(p)
        self.buckets: list[Bucket] = []
        self.shards: list[nn.Parameter] = []
        for (dtype, groups, _, _), ps in by_key.items():
            numels = [_local(p).numel() for p in ps]
            per = -(-sum(numels) // size)
            # The master slice is fp32 (fp64 for fp64 parameters).
            mdt = torch.float64 if dtype == torch.float64 else torch.float32
            flat = self._flat(ps, numels, per, mdt, lambda p: _local(p).detach())
            self.buckets.append(Bucket(ps, numels, per, groups))
            self.shards.append(nn.Parameter(flat[self.rank * per:(self.rank + 1) * per].clone()))

    def _flat(self, ps, numels, per, dtype, get) -> torch.Tensor:
        flat = torch.zeros(per * self.size, dtype=dtype, device=_local(ps[0]).device)
        off = 0
        for p, n in zip(ps, numels):
            t = get(p)
            if t is not None:
                flat[off:off + n] = _local(t).reshape(-1).to(dtype)
            off += n
        return flat

    def refresh_master(self) -> None:
        """Copy the parameters into this rank's master slices (after a load)."""
        with torch.no_grad():
            for b, shard in zip(self.buckets, self.shards):
                flat = self._flat(b.params, b.numels, b.per, shard.dtype, lambda p: p.detach())
                shard.copy_(flat[self.rank * b.per:(self.rank + 1) * b.per].to(shard.device))

    def sync(self) -> None:
        """Reduce-scatter (and average) every bucket's gradients into the slices."""
        for b, shard in zip(self.buckets, self.shards):
            flat = self._flat(b.params, b.numels, b.per, shard.dtype, lambda p: p.grad)
            if self.reduce is not None and self.reduce != flat.dtype:
                # ``precision(reduce=...)``: divided first (a float16 sum stays in range),
                # summed in the narrow dtype, widened into the master slice's gradient
                flat = flat.div_(self.size).to(self.reduce)
                out = torch.empty(b.per, dtype=self.reduce, device=self.device)
                reduce_scatter_into(out, flat, self.group)
                shard.grad = out.to(shard.dtype).to(shard.device)
                continue
            out = torch.empty(b.per, dtype=shard.dtype, device=self.device)
            reduce_scatter_into(out, flat, self.group)
            shard.grad = out.div_(self.size).to(shard.device)

    def gather(self) -> None:
        """All-gather the updated slices back into the parameters."""
        with torch.no_grad():
            for b, shard in zip(self.buckets, self.shards):
                full = torch.empty(b.per * self.size, dtype=shard.dtype, device=self.device)
                all_gather_into(full, shard.detach().to(self.device), self.group)
                off = 0
                for p, n in zip(b.params, b.numels):
                    loc = _local(p)
                    loc.copy_(full[off:off + n].view_as(loc).to(loc.dtype))
                    off += n

    def full_state(self, flat_local: torch.Tensor, b: Bucket) -> list[torch.Tensor]:
        """One optimizer-state slice -> the local block of every parameter of ``b``."""
        full = torch.empty(b.per * self.size, dtype=flat_local.dtype, device=self.device)
        all_gather_into(full, flat_local.contiguous().to(self.device), self.group)
        out, off = [], 0
        for p, n in zip(b.params, b.numels):
            out.append(full[off:off + n].view(_local(p).shape).clone())
            off += n
        return out

    def slice_state(self, parts: list[torch.Tensor], b: Bucket, like: torch.Tensor) -> torch.Tensor:
        """The inverse of ``full_state``: this rank's slice of the parameters' blocks."""
        full = torch.zeros(b.per * self.size, dtype=like.dtype, device=like.device)
        off = 0
        for t, n in zip(parts, b.numels):
            full[off:off + n] = _local(t).reshape(-1).to(like.device)
            off += n
        return full[self.rank * b.per:(self.rank + 1) * b.per]
