"""``DPPluginBase``: Colossal-AI's base of the data-parallel plugins, for scripts that
subclass it for its ``prepare_dataloader`` (every rank a data-parallel rank)."""

from __future__ import annotations


class DPPluginBase:
    """A plugin whose every rank is a data-parallel rank: ``prepare_dataloader`` gives
    each rank ``batch_size`` distinct samples per step, as ``meshlab.dataloader`` does over
    a ``dp`` axis of the whole world. The process group must exist (``launch`` first)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from ...core.errors import MeshError

        if not dist.is_initialized():
            raise MeshError(f"{type(self).__name__}(): no process group; call "
                            f"meshlab.booster.launch(...) or launch_from_torch() first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def prepare_dataloader(self, dataset, batch_size: int, shuffle: bool = False,
                           seed: int = 1024, drop_last: bool = False, pin_memory: bool = False,
                           num_workers: int = 0, **kwargs):
        """A DataLoader of ``batch_size`` samples per rank, distinct across ranks."""
        import torch.distributed as dist

        from ...core.mesh import Mesh
        from ...train.data import dataloader

        mesh = Mesh({"dp": dist.get_world_size()})
        return dataloader(dataset, mesh, batch_size * mesh.axis_size("dp"), axes=("dp",),
                          shuffle=shuffle, seed=seed, drop_last=drop_last,
                          pin_memory=pin_memory, num_workers=num_workers, **kwargs)
