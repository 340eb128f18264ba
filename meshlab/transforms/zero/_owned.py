"""ZeRO-1 for optimizers that read whole tensors: each parameter owned by one data rank.

Optimizers that are not elementwise (LAMB's and LARS's trust ratios, Adafactor's factored
moments, Muon's orthogonalization of each matrix) compute reductions over a whole tensor,
so a flat slice of several parameters (``Zero1Buffers``) would give them the wrong
tensors. Here the optimizer's work is partitioned by whole tensors instead, as
distributed Muon implementations do:

* each parameter is owned by one data rank, chosen greedily by size (largest first, each
  to the rank holding the fewest bytes so far, the lowest rank on ties), so the ranks'
  bytes balance; the choice is ``owners`` (FQN -> data rank), the same on every rank, and
  depends only on the parameters' global shapes and dtypes, so tensor-parallel peers agree;
* the summed gradient reaches the owner through the same reduce-scatter the elementwise
  path runs (each rank's "slice" is the concatenation of the parameters it owns, padded
  to the longest), averaged alike, so the sum is the elementwise path's; each parameter's
  block is followed by one element, 1 where a rank has a gradient for it, so the owner
  reads how many data ranks had one: none (a branch no rank's batch used this step) and
  the owner leaves the parameter and its optimizer state alone, as one process's
  optimizer skips a parameter whose gradient is None; some, and it steps the sum, the
  other ranks having added zeros;
* the owner steps its fp32 master of each whole parameter (a DTensor over the tensor axes
  where the parameter is one, so norms and products stay the whole tensor's) with the
  optimizer's own code and holds its state;
* the updated masters go back to every rank through the all-gather of the same padded
  layout (a broadcast from each owner).

Optimizer state costs a rank the state of the parameters it owns (about 1/dp of the total
when no tensor is much larger than the others); the masters cost the owned parameters'
size in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ...core.collectives import all_gather_into, reduce_scatter_into
from ...core.tensors import local as _local, shard_groups
from ._zero1 import Bucket


class _Entry(NamedTuple):
    param: nn.Parameter
    numel: int              # its local block's
    owner: int              # the data rank that steps it
    offset: int             # where its block lies in the owner's part of the buffer (the
                            # element after it counts the data ranks with a gradient)


class _Layout(NamedTuple):
    """One bucket (dtype, tensor-parallel sharding, parameter group) of parameters laid out
    by owner: rank ``r``'s part of the flat buffer is ``[r * per, (r + 1) * per)``."""

    entries: list
    per: int
    dtype: torch.dtype      # the masters' (fp32, or fp64 for fp64 parameters)
    groups: tuple


def _like(p, loc: torch.Tensor) -> torch.Tensor:
    """``loc`` (a local block shaped like ``p``'s) as a DTensor laid out as ``p`` where
    ``p`` is one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return loc
    return DTensor.from_local(loc, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def assign_owners(sizes: list[int], ranks: int, loads: list[int] | None = None) -> list[int]:
    """Each of ``sizes`` (bytes) to a rank: largest first, to the rank with the fewest
    bytes so far (``loads``, updated in place), the lowest rank on ties.

    >>> assign_owners([4, 8, 2, 2, 1], 2)
    [1, 0, 1, 1, 0]
    """
    loads = [0] * ranks if loads is None else loads
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += sizes[i]
    return owner


class Zero1Whole:
    """This rank's masters of the parameters it owns (``shards``, each with a one-parameter
    ``Bucket`` in ``buckets``) and the layouts that reduce and gather them."""

    whole = True

    def __init__(self, named: list, group, size: int, group_of: dict | None = None,
                 reduce: torch.dtype | None = None):
        group_of = group_of or {}
        self.group, self.size, self.rank = group, size, dist.get_rank(group)
        self.reduce = reduce
        self.device = _local(named[0][1]).device if named else None
        by_key: dict = {}
        for n, p in named:
            key = (p.dtype, shard_groups(p), group_of.get(id(p), 0))
            by_key.setdefault(key, []).append((n, p))
        loads = [0] * size
        self.owners: dict[str, int] = {}        # FQN -> the data rank that steps it
        self.layouts: list[_Layout] = []
        self.buckets: list[Bucket] = []
        self.shards: list[nn.Parameter] = []
        self.master: dict[int, nn.Parameter] = {}   # id(parameter) -> its master (owned)
        for (dtype, groups, _), ps in by_key.items():
            mdt = torch.float64 if dtype == torch.float64 else torch.float32
            # global sizes: tensor-parallel peers (other local blocks) choose alike
            owner = assign_owners([p.numel() * mdt.itemsize for _, p in ps], size, loads)
            fill, entries = [0] * size, []
            for (n, p), r in zip(ps, owner):
                k = _local(p).numel()
                entries.append(_Entry(p, k, r, fill[r]))
                fill[r] += k + 1
                self.owners[n] = r
                if r == self.rank:
                    m = nn.Parameter(_like(p, _local(p).detach().to(mdt).clone()))
                    self.master[id(p)] = m
                    self.buckets.append(Bucket([p], [k], k, groups))
                    self.shards.append(m)
            self.layouts.append(_Layout(entries, max(fill), mdt, groups))

    def refresh_master(self) -> None:
        """Copy the parameters into this rank's masters (after a load)."""
        with torch.no_grad():
            for b, m in zip(self.buckets, self.shards):
                _local(m).copy_(_local(b.params[0]))

    def sync(self) -> None:
        """Reduce-scatter (and average) every layout's gradients: each owner gets the sum
        of its parameters' gradients, as ``Zero1Buffers.sync`` sums them, and with each the
        count of data ranks that had one. A parameter no rank has a gradient for keeps
        ``grad=None`` on its master (the optimizer skips it, as one process's does); the
        owner reads the counts only where it has no gradient of its own for a parameter it
        owns (else some rank had one), so the common step reads nothing."""
        for lay in self.layouts:
            if lay.per == 0:
                continue
            flat = torch.zeros(lay.per * self.size, dtype=lay.dtype, device=self.device)
            for e in lay.entries:
                if e.param.grad is not None:
                    at = e.owner * lay.per + e.offset
                    flat[at:at + e.numel] = _local(e.param.grad).reshape(-1).to(lay.dtype)
                    flat[at + e.numel] = 1
            if self.reduce is not None and self.reduce != lay.dtype:
                # ``precision(reduce=...)``: as Zero1Buffers.sync (the counts divided too,
                # and compared with zero only)
                flat = flat.div_(self.size).to(self.reduce)
                out = torch.empty(lay.per, dtype=self.reduce, device=self.device)
                reduce_scatter_into(out, flat, self.group)
                out = out.to(lay.dtype)
            else:
                out = torch.empty(lay.per, dtype=lay.dtype, device=self.device)
                reduce_scatter_into(out, flat, self.group)
                out.div_(self.size)
            mine = [e for e in lay.entries if id(e.param) in self.master]
            counts = out[[e.offset + e.numel for e in mine]].tolist() \
                if any(e.param.grad is None for e in mine) else [1] * len(mine)
            for e, n in zip(mine, counts):
                m = self.master[id(e.param)]
                if n == 0:              # no data rank has a gradient: not stepped
                    m.grad = None
                    continue
                g = out[e.offset:e.offset + e.numel].view(_local(e.param).shape)
                m.grad = _like(e.param, g.to(_local(m).device))

    def gather(self) -> None:
        """Each owner's updated masters to every rank (the all-gather of the layout)."""
        with torch.no_grad():
            for lay in self.layouts:
                if lay.per == 0:
                    continue
                mine = torch.zeros(lay.per, dtype=lay.dtype, device=self.device)
                for e in lay.entries:
                    m = self.master.get(id(e.param))
                    if m is not None:
                        mine[e.offset:e.offset + e.numel] = _local(m).detach().reshape(-1)
                full = torch.empty(lay.per * self.size, dtype=lay.dtype, device=self.device)
                all_gather_into(full, mine, self.group)
                for e in lay.entries:
                    loc = _local(e.param)
                    at = e.owner * lay.per + e.offset
                    loc.copy_(full[at:at + e.numel].view_as(loc).to(loc.dtype))

    def grad_items(self) -> list:
        """The owned masters' local gradients with the groups they are split over; a
        layout this rank owns nothing of gives an empty gradient, so every rank reduces
        the norm over the same groups in the same order."""
        out = []
        for lay in self.layouts:
            got = [(_local(self.master[id(e.param)].grad), lay.groups + (self.group,))
                   for e in lay.entries if id(e.param) in self.master
                   and self.master[id(e.param)].grad is not None]
            out += got or [(torch.zeros(0, dtype=lay.dtype, device=self.device),
                            lay.groups + (self.group,))]
        return out

    def owner_of(self, p) -> int:
        """The data rank that steps parameter ``p``."""
        return next(e.owner for lay in self.layouts for e in lay.entries if e.param is p)

    def share(self, p, obj):
        """``obj`` from the owner of ``p`` to every data rank (a collective of the group)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=self.owner_of(p))
        return box[0]
