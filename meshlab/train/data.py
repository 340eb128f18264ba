"""``dataloader``: the global batch split over the data-parallel axes of a mesh (the
plan's, when it is given the model)."""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from ..core.errors import ConfigError


_DATA_NAMES = ("dp", "fsdp", "data", "ddp")    # axes a mesh alone is read to split data over


def _check_args(dataset, mesh, batch_size, axes, model, plan, shuffle, seed,
                drop_last) -> None:
    """``dataloader``'s arguments, each refused by name before any sampler is built."""
    from torch import nn

    from ..core.errors import ConfigTypeError, MeshError, check_bool, check_int, check_names
    from ..core.mesh import MeshBase
    from ..planning.plan import Plan

    call = "dataloader"
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigTypeError(f"{call}: dataset must be a map-style dataset (with __len__ and "
                              f"__getitem__, e.g. meshlab.data.TextDataset), got "
                              f"{type(dataset).__name__}")
    if mesh is not None and not isinstance(mesh, MeshBase):
        raise MeshError(f"{call}: mesh must be a meshlab.Mesh (or None with model=), got "
                        f"{type(mesh).__name__}")
    check_int(batch_size, call, "batch_size", example=8)
    if isinstance(axes, str) or axes is not None and not isinstance(axes, (tuple, list)):
        raise ConfigTypeError(f"{call}(axes={axes!r}): axes is a tuple of mesh axis names in "
                              f"mesh order, e.g. axes=('dp',), or () for none")
    if axes:
        check_names(axes, call, "axes")
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigTypeError(f"{call}(model=...): the parallelized nn.Module, got "
                              f"{type(model).__name__}")
    if plan is not None and not isinstance(plan, Plan):
        raise ConfigTypeError(f"{call}(plan=...): a bound meshlab Plan, got "
                              f"{type(plan).__name__}")
    check_bool(shuffle, call, "shuffle")
    check_bool(drop_last, call, "drop_last")
    check_int(seed, call, "seed", low=0, example=0)


def dataloader(dataset, mesh, batch_size: int, *, axes: Iterable[str] | None = None,
               model=None, plan=None, shuffle: bool = True, seed: int = 0,
               drop_last: bool = True, **kwargs):
    """A DataLoader giving each data-parallel rank distinct samples and every other rank
    (tensor-parallel, pipeline, sequence peers) the same ones as its data-parallel peers.
    ``batch_size`` is the *global* batch; each data-parallel rank gets ``batch_size / dp``.

    The data axes come from, in order: ``axes``; the plan of ``model`` (a parallelized
    model) or ``plan`` (a bound plan), whose data axes are those gradients are averaged
    over, whatever their names (``mesh`` may then be None); else the mesh's axes named
    ``dp``, ``fsdp``, ``data`` or ``ddp``. A mesh of several ranks with none of those
    names raises ``ConfigError``: pass ``model=``. Passing ``model=`` is the exact form
    (tensor parallelism on an axis named ``dp`` would otherwise be read as data).
    """
    from torch.utils.data.distributed import DistributedSampler

    _check_args(dataset, mesh, batch_size, axes, model, plan, shuffle, seed, drop_last)
    mesh, axes = _data_axes(mesh, axes, model, plan)
    for a in axes:
        mesh.axis_size(a)
    dp = math.prod(mesh.axis_size(a) for a in axes) if axes else 1
    if batch_size % dp:
        raise ConfigError(f"dataloader: global batch {batch_size} does not divide over the "
                          f"{dp} data-parallel ranks of {axes}; use a multiple of {dp}")
    coord = mesh.coordinate(mesh.rank)
    rank = 0
    for a in axes:
        rank = rank * mesh.axis_size(a) + coord[a]
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    # An own generator: starting an epoch must not draw from the global RNG (a resumed
    # run starts its iterator at a different moment than the uninterrupted one).
    kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
    return MeshDataLoader(dataset, batch_size=batch_size // dp, sampler=sampler,
                          drop_last=drop_last, **kwargs)


def _data_axes(mesh, axes, model, plan) -> tuple:
    """(mesh, data axes) for ``dataloader`` (see its docstring)."""
    if model is not None:
        from ..transforms._install import runtime_of

        rt = runtime_of(model)
        plan, mesh = plan or rt.plan, mesh if mesh is not None else rt.mesh
    if plan is not None:
        if not plan.is_bound:
            raise ConfigError("dataloader(plan=...): the plan is not bound to a mesh; pass "
                              "ml.plan(model, spec, mesh) or the parallelized model (model=)")
        if mesh is None:
            raise ConfigError("dataloader(plan=...): pass the mesh the plan is bound to too")
        if dict(mesh.shape) != plan.mesh_shape:
            raise ConfigError(f"dataloader: {mesh!r} is not the mesh the plan is bound to "
                              f"{plan.mesh_shape}; pass that mesh (or mesh=None with model=)")
        data = tuple(plan.roles.data)
        if axes is not None and tuple(axes) != data:
            raise ConfigError(f"dataloader(axes={tuple(axes)}): the plan's data axes are "
                              f"{data}; leave axes out to use them")
        return mesh, data
    if mesh is None:
        raise ConfigError("dataloader: give the mesh, or the parallelized model (model=)")
    if axes is not None:
        return mesh, tuple(axes)
    found = tuple(a for a in mesh.axis_names if a in _DATA_NAMES)
    if not found and mesh.size > 1:
        raise ConfigError(
            f"dataloader: no axis of {mesh!r} is named {' / '.join(_DATA_NAMES)}, so the "
            f"mesh alone does not say which axes carry data parallelism (ranks along them "
            f"must read distinct samples, the others the same ones). Pass the parallelized "
            f"model (dataloader(data, mesh, batch_size, model=model)): its plan knows; or "
            f"axes=(...) naming them (axes=() gives every rank the same samples)")
    return mesh, found


class MeshDataLoader(torch.utils.data.DataLoader):
    """A DataLoader that knows its position: each pass over it is a new epoch (the
    sampler reshuffles), and ``state_dict`` / ``load_state_dict`` resume mid-epoch (a
    checkpoint saves it with ``dataloader=``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._epoch, self._served, self._skip = 0, 0, 0

    def __iter__(self):
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self._epoch)
        skip, self._skip = self._skip, 0
        self._served = skip
        for i, batch in enumerate(super().__iter__()):
            if i < skip:
                continue
            self._served = i + 1
            yield batch
        self._epoch += 1
        self._served = 0

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "served": self._served}

    def load_state_dict(self, state: Mapping) -> None:
        """The position ``state_dict`` gave: the next pass resumes that epoch after its
        served batches (a save before that pass records the same position), or starts the
        next epoch where every batch of that one was served."""
        self._epoch, self._skip = int(state["epoch"]), int(state["served"])
        try:
            whole = self._skip >= len(self) > 0
        except TypeError:              # an iterable dataset: no length to compare
            whole = False
        if whole:
            self._epoch, self._skip = self._epoch + 1, 0
        self._served = self._skip
