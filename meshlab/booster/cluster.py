"""Colossal-AI's ``DistCoordinator``: who this process is among the launched ranks, and
running a piece of code on one of them.

>>> from meshlab.booster.cluster import DistCoordinator
>>> DistCoordinator().is_master()  # doctest: +SKIP
True
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch.distributed as dist

from ..core.errors import ConfigError


class DistCoordinator:
    """The launched world as this process sees it (one process without a process group:
    rank 0 of 1)."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def local_rank(self) -> int:
        v = os.environ.get("LOCAL_RANK")
        if v is None:
            raise ConfigError("DistCoordinator.local_rank: LOCAL_RANK is not set; launch with "
                              "torchrun or meshlab run, or call meshlab.booster.launch")
        return int(v)

    def is_master(self, process_group=None) -> bool:
        """Rank 0 of ``process_group`` (of the world by default)."""
        if not dist.is_initialized():
            return True
        return dist.get_rank(group=process_group) == 0

    def is_node_master(self) -> bool:
        return self.local_rank == 0

    def is_last_process(self, process_group=None) -> bool:
        if not dist.is_initialized():
            return True
        return dist.get_rank(process_group) == dist.get_world_size(process_group) - 1

    def print_on_master(self, msg: str, process_group=None) -> None:
        if self.is_master(process_group):
            print(msg)

    def print_on_node_master(self, msg: str) -> None:
        if self.is_node_master():
            print(msg)

    def block_all(self, process_group=None) -> None:
        """A barrier over ``process_group``."""
        if dist.is_initialized():
            dist.barrier(group=process_group)

    @contextlib.contextmanager
    def priority_execution(self, executor_rank: int = 0, process_group=None):
        """The body runs on ``executor_rank`` first, then on the others (a download or a
        cache build done once)."""
        first = not dist.is_initialized() or dist.get_rank(process_group) == executor_rank
        if not first:
            self.block_all(process_group)
        yield
        if first:
            self.block_all(process_group)

    def destroy(self, process_group=None) -> None:
        if dist.is_initialized():
            dist.destroy_process_group(process_group)

    def on_master_only(self, process_group=None):
        """A decorator: the function runs on the master rank only (None elsewhere)."""
        def decorator(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                return func(*args, **kwargs) if self.is_master(process_group) else None
            return wrapper
        return decorator


class ProcessGroupMesh:
    """Colossal-AI's ``ProcessGroupMesh`` as a script reads it (``plugin.pg_mesh``): the
    launched ranks laid out on the plugin's mesh. ``get_ranks_in_group(group)`` are the
    global ranks of one of its groups (``plugin.pp_group``, ``plugin.dp_group``, ...);
    ``shape``, ``rank`` and ``coordinate()`` are the mesh's. The meshlab mesh itself is
    ``mesh``."""

    def __init__(self, mesh):
        self.mesh = mesh

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mesh.shape_tuple

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def coordinate(self, dim: int | None = None):
        """This rank's index on every mesh dimension, or on dimension ``dim``."""
        where = self.mesh.coordinate(dist.get_rank())
        coord = tuple(where[a] for a in self.mesh.axis_names)
        return coord if dim is None else coord[dim]

    @staticmethod
    def get_ranks_in_group(group) -> list[int]:
        """The global ranks of ``group``, in its order."""
        return dist.get_process_group_ranks(group)
