"""A plugin's mesh as Colossal-AI scripts read it: ``plugin.stage_manager`` (None without
pipeline parallelism) and the process group of each axis (``dp_group``, ``tp_group``,
...). Only the Colossal-AI surface hands out process groups: meshlab's own API names axes."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class StageManager:
    """This rank's pipeline stage: ``stage`` of ``num_stages`` over the ``pp`` axis."""

    stage: int
    num_stages: int
    pp_group: object

    def is_first_stage(self) -> bool:
        return self.stage == 0

    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1


def axis_group(plugin, axis: str):
    """The process group of this rank along ``axis`` of the plugin's mesh (None where the
    plugin's mesh has no such axis: a size of 1)."""
    mesh = plugin.mesh
    if axis not in mesh.axis_names:
        return None
    return mesh.device_mesh.get_group(axis)


def data_group(plugin):
    """The group gradients are averaged over: ``dp`` (with ``ep`` under MoE, flattened)."""
    axes = [a for a in plugin.stack.data_axes if a in plugin.mesh.axis_names]
    if len(axes) == 1:
        return axis_group(plugin, axes[0])
    if not axes:
        return None
    return plugin.mesh.flatten(*axes).device_mesh.get_group(0)


def stage_manager(plugin) -> StageManager | None:
    mesh = plugin.mesh
    if "pp" not in mesh.axis_names:
        return None
    group = axis_group(plugin, "pp")
    return StageManager(dist.get_rank(group), mesh.axis_size("pp"), group)
