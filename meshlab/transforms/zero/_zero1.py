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
                 group_of: dict | None = None, reduce: torch.dtype | None = None,
                 names: dict | None = None, reduced: bool = False, device=None):
        # ``apart``: ids of parameters bucketed on their own (offload moves their slices to
        # the host; a slice may then live on another device than the parameters).
        # ``group_of``: id -> the optimizer's parameter group; a bucket holds one group's.
        group_of = group_of or {}
        self.names = names or {}    # id -> FQN, for the refusal of an unused parameter
        self.group, self.size, self.rank = group, size, dist.get_rank(group)
        self.reduce = reduce        # the dtype gradients are reduce-scattered in (None: fp32)
        # ``reduced``: the backward averaged every gradient over the group already (FSDP2's
        # units over a size-1 shard dimension, parameters resting on the host): each slice
        # takes its part as it is. ``device``: where the collectives run (the parameters
        # may rest on the host, where NCCL cannot reach them).
        self.reduced = reduced
        self.device = device if device is not None else (
            _local(params[0]).device if params else None)
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

    def _flat_with_counts(self, b: Bucket, dtype) -> torch.Tensor:
        """The bucket's gradients laid out for the reduce-scatter: rank ``r``'s part is its
        slice of the flat gradients (zeros where this rank has none) followed by one
        element per parameter of the bucket, 1 where this rank has its gradient, so every
        rank receives the count of data ranks that had each one."""
        k = len(b.params)
        buf = torch.zeros(self.size, b.per + k, dtype=dtype, device=self.device)
        off = 0
        for p, n in zip(b.params, b.numels):
            g = p.grad
            if g is not None:
                src = _local(g).reshape(-1).to(dtype)
                i = 0
                while i < n:            # the block over the ranks' slices it spans
                    r, c = divmod(off + i, b.per)
                    take = min(b.per - c, n - i)
                    buf[r, c:c + take] = src[i:i + take]
                    i += take
            off += n
        have = [1.0 if p.grad is not None else 0.0 for p in b.params]
        buf[:, b.per:] = torch.tensor(have, dtype=dtype, device=self.device)
        return buf.reshape(-1)

    def sync(self) -> None:
        """Reduce-scatter (and average) every bucket's gradients into the slices.

        A parameter no data rank has a gradient for (a branch, head or expert no sample
        of the step used) is one that one process's optimizer skips: no weight decay, no
        moment update, no step counted. A slice holds several parameters under one step
        count and one update, so it cannot skip one: that step is refused by name
        (``unused_refusal``) on every rank. A parameter only some ranks have a gradient for
        is stepped on the sum, the others adding zeros, as one process would. Only a rank
        missing a gradient of its own reads the counts (a parameter no rank has one for is
        missing on every rank, so every rank reads it and raises alike)."""
        if self.reduced:
            self._take_reduced()
            return
        short = []
        for b, shard in zip(self.buckets, self.shards):
            k = len(b.params)
            flat = self._flat_with_counts(b, shard.dtype)
            if self.reduce is not None and self.reduce != flat.dtype:
                # ``precision(reduce=...)``: divided first (a float16 sum stays in range),
                # summed in the narrow dtype, widened into the master slice's gradient
                # (the counts divided too: compared with zero only)
                flat = flat.div_(self.size).to(self.reduce)
                out = torch.empty(b.per + k, dtype=self.reduce, device=self.device)
                reduce_scatter_into(out, flat, self.group)
                shard.grad = out[:b.per].to(shard.dtype).to(shard.device)
            else:
                out = torch.empty(b.per + k, dtype=shard.dtype, device=self.device)
                reduce_scatter_into(out, flat, self.group)
                shard.grad = out[:b.per].div_(self.size).to(shard.device)
            if any(p.grad is None for p in b.params):
                short.append((b, out[b.per:]))
        unused = [self.names.get(id(p), f"parameter {tuple(p.shape)}")
                  for b, counts in short for p, n in zip(b.params, counts.tolist()) if n == 0]
        if unused:
            raise unused_refusal(unused)

    def _take_reduced(self) -> None:
        """Each slice's part of gradients the backward already averaged over the group.
        A parameter without one has none on any data rank (FSDP2's ``UnusedGrads`` made
        the ranks agree), so every rank refuses the step alike, with no collective."""
        unused = [self.names.get(id(p), f"parameter {tuple(p.shape)}")
                  for b in self.buckets for p in b.params if p.grad is None]
        if unused:
            raise unused_refusal(unused)
        for b, shard in zip(self.buckets, self.shards):
            flat = self._flat(b.params, b.numels, b.per, shard.dtype, lambda p: p.grad)
            shard.grad = flat[self.rank * b.per:(self.rank + 1) * b.per].to(
                shard.device, copy=True)

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


def unused_refusal(names: list[str]):
    """The error of a ZeRO-1 step on flat slices in which ``names`` got no gradient on any
    data rank."""
    from ...core.errors import ConfigError

    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return ConfigError(
        f"zero_shard(1): {shown} got no gradient on any data rank in this step (a branch, "
        f"head or expert that no sample of the step used). One process's optimizer skips "
        f"such a parameter (no weight decay, no moment update, no step counted); ZeRO-1 "
        f"steps flat slices that hold several parameters under one update and one step "
        f"count, so it cannot skip one, and refuses the step rather than train differently. "
        f"Freeze the parameters no step uses (p.requires_grad_(False) before "
        f"meshlab.parallelize); for parameters used on some steps only, build the optimizer "
        f"with meshlab.optimizer(model, cls, ..., zero1_whole=True) (each parameter stepped "
        f"whole by one data rank, which skips it as one process does), or lay the model out "
        f"with data_parallel, zero_shard(2) or zero_shard(3)")
