"""DTensors stepped as whole plain tensors, each by one owner among the ranks that hold it.

Some optimizers cannot run on DTensor parameters (tensor parallelism by specs,
``zero_shard(3)``): torch's Adafactor squares a pending row norm in place, which DTensor
refuses. ``WholeTensors`` gives such an optimizer, for each DTensor it would step, a plain
tensor of the full shape (its stand-in), held only by the tensor's owner: one rank of the
DTensor's mesh, chosen greedily by size so each rank of a mesh holds about as many bytes
(largest first, to the rank with the fewest so far, the lowest on ties).

Each step, before the optimizer's: every rank of the mesh gathers the tensor's full
gradient and value (``full_tensor``; two all-gathers) and the owner copies them into its
stand-in. After it: the owner's updated stand-in is broadcast over the mesh (one broadcast
per mesh dimension) and every rank writes its local shard back into the DTensor. The
optimizer's own code runs on the whole tensor, so the update is one process's.

Memory: the owner holds each stand-in (the full tensor) and the optimizer's state of the
whole tensor (for Adafactor its factored moments: a row and a column vector per matrix);
over a mesh of ``n`` ranks each holds about ``1/n`` of them. Every rank briefly holds one
full tensor and its gradient at a time while they are gathered and written back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..core.tensors import local as _local


class _Whole(NamedTuple):
    tensor: torch.Tensor            # the DTensor the optimizer would step
    owner: tuple                    # the owner's coordinate on the tensor's mesh
    standin: nn.Parameter | None    # the full plain tensor, on the owner only


def _coordinate(mesh, flat: int) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(mesh.shape)))


def _broadcast(t: torch.Tensor, mesh, owner: tuple) -> None:
    """``t`` from the rank at ``owner`` on ``mesh`` to every rank of it, one mesh dimension
    at a time (the last first: the owner's row has it, then every row)."""
    for d in reversed(range(mesh.ndim)):
        if mesh.size(d) > 1:
            dist.broadcast(t, group=mesh.get_group(d), group_src=owner[d])


def _broadcast_object(obj, mesh, owner: tuple):
    box = [obj]
    for d in reversed(range(mesh.ndim)):
        if mesh.size(d) > 1:
            dist.broadcast_object_list(box, group=mesh.get_group(d), group_src=owner[d])
    return box[0]


class WholeTensors:
    """For each DTensor of ``tensors`` (in order, the same on every rank of its mesh): its
    owner, and on the owner a plain stand-in of the full tensor the optimizer steps."""

    def __init__(self, tensors: list):
        from torch.distributed.tensor import DTensor

        from ..transforms.zero._owned import assign_owners

        by_mesh: dict = {}
        for t in tensors:
            if isinstance(t, DTensor):
                by_mesh.setdefault(t.device_mesh, []).append(t)
        owner_of: dict[int, tuple] = {}
        for mesh, ts in by_mesh.items():
            flat = assign_owners([t.numel() * t.dtype.itemsize for t in ts], mesh.size())
            for t, r in zip(ts, flat):
                owner_of[id(t)] = _coordinate(mesh, r)
        self.entries: list[_Whole] = []
        self.standin: dict[int, nn.Parameter] = {}      # id(DTensor) -> its stand-in
        for t in tensors:
            if id(t) not in owner_of:
                continue
            full = t.detach().full_tensor()             # a collective of t's mesh
            mine = tuple(t.device_mesh.get_coordinate()) == owner_of[id(t)]
            s = nn.Parameter(full.clone()) if mine else None
            if s is not None:
                self.standin[id(t)] = s
            self.entries.append(_Whole(t, owner_of[id(t)], s))

    def replace(self, tensors: list) -> list:
        """``tensors`` as the optimizer steps them: each DTensor by its stand-in where this
        rank owns it, left out where another rank does."""
        from torch.distributed.tensor import DTensor

        return [self.standin[id(t)] if id(t) in self.standin else t for t in tensors
                if not isinstance(t, DTensor) or id(t) in self.standin]

    def before_step(self) -> None:
        """The full gradients and values into the owners' stand-ins (collectives of each
        DTensor's mesh; a tensor without a gradient, on every rank alike, is skipped)."""
        with torch.no_grad():
            for e in self.entries:
                g = e.tensor.grad
                if g is None:
                    if e.standin is not None:
                        e.standin.grad = None
                    continue
                full_g = g.full_tensor() if hasattr(g, "full_tensor") else g
                full = e.tensor.detach().full_tensor()
                if e.standin is not None:
                    e.standin.copy_(full)
                    e.standin.grad = full_g.to(e.standin.dtype)

    def after_step(self) -> None:
        """Each owner's updated stand-in to every rank of the mesh, written back as its
        local shard."""
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for e in self.entries:
                if e.tensor.grad is None:
                    continue
                t = e.tensor
                full = e.standin.detach().clone() if e.standin is not None else \
                    torch.empty(t.shape, dtype=t.dtype, device=_local(t).device)
                _broadcast(full, t.device_mesh, e.owner)
                mine = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
                _local(t).copy_(mine.to_local())

    def refresh(self) -> None:
        """The stand-ins take the DTensors' values (after a load; a collective)."""
        with torch.no_grad():
            for e in self.entries:
                full = e.tensor.detach().full_tensor()
                if e.standin is not None:
                    e.standin.copy_(full)

    def holder(self, t):
        """The tensor the optimizer steps for ``t`` on this rank (its stand-in, ``t``
        itself, or None where another rank owns it)."""
        for e in self.entries:
            if e.tensor is t:
                return e.standin
        return t

    def share(self, t, obj):
        """``obj`` from the owner of ``t`` to every rank of its mesh (a collective of it);
        ``obj`` as is where ``t`` is stepped as itself."""
        for e in self.entries:
            if e.tensor is t:
                return _broadcast_object(obj, t.device_mesh, e.owner)
        return obj
