"""``dataloader``: the global batch split over the data-parallel axes of a mesh."""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from ._errors import ConfigError


def dataloader(dataset, mesh, batch_size: int, *, axes: Iterable[str] | None = None,
               shuffle: bool = True, seed: int = 0, drop_last: bool = True, **kwargs):
    """A DataLoader giving each data-parallel rank distinct samples and tensor-parallel
    peers the same ones. ``batch_size`` is the *global* batch; each data-parallel rank
    gets ``batch_size / dp``. ``axes`` are the data-parallel mesh axes (default: those of
    ``dp``, ``fsdp``, ``data`` present in the mesh)."""
    from torch.utils.data.distributed import DistributedSampler

    axes = tuple(axes) if axes is not None else tuple(a for a in mesh.axis_names
                                                      if a in ("dp", "fsdp", "data", "ddp"))
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
        self._epoch, self._skip, self._served = int(state["epoch"]), int(state["served"]), 0
