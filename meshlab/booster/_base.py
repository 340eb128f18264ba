"""``Plugin``: a Colossal-AI plugin as a value. Its constructor binds the arguments
against its ``ARGS`` table; ``_build`` turns them into a ``Stack``; the mesh over the
launched ranks and ``prepare_dataloader`` come from that stack."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from ..core.errors import MeshError
from ._args import Arg, UnsupportedArgument, bind, signature
from ._common import Stack


def _clean(spec):
    """``spec`` without its ``identity()`` parts (the neutral start of a stack)."""
    from ..transforms import Identity

    parts = [t for t in getattr(spec, "parts", (spec,)) if not isinstance(t, Identity)]
    if not parts:
        return Identity()
    out = parts[0]
    for t in parts[1:]:
        out = out | t
    return out


class Plugin:
    """A Colossal-AI plugin: a mesh shape plus a stack of meshlab transforms.

    ``plugin.spec`` is the transform stack; ``plugin.mesh_shape(world)`` the axes;
    ``plugin.mesh`` the mesh over the launched ranks; ``plugin.arguments`` every
    argument's value. ``Booster(plugin=...).plan(model, world_size=N)`` plans what
    ``boost`` will run, on a fake mesh of N ranks.
    """

    ARGS: ClassVar[tuple[Arg, ...]] = ()
    POSITIONAL: ClassVar[int] = 0
    controls_precision: ClassVar[bool] = True
    supports_pipeline: ClassVar[bool] = False

    def __init__(self, *args, **kwargs) -> None:
        name = type(self).__name__
        self.arguments: dict = bind(name, self.ARGS, self.POSITIONAL, args, kwargs)
        self._mesh = None
        st = self._build(self.arguments)              # every check runs here
        self._stack = dataclasses.replace(st, spec=_clean(st.spec))

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.__signature__ = signature(cls.ARGS, cls.POSITIONAL)

    # -- what a plugin is --------------------------------------------------------------
    def _build(self, v: dict) -> Stack:
        raise NotImplementedError

    def _sizes(self) -> dict:
        """The fixed axis sizes (``dp`` is what the world leaves)."""
        return {}

    @property
    def stack(self) -> Stack:
        return self._stack

    @property
    def spec(self):
        """The transforms this plugin runs (the Booster adds its ``mixed_precision``)."""
        return self._stack.spec

    def mesh_shape(self, world: int) -> dict:
        """``{axis: size}`` on ``world`` ranks, in this plugin's axis order."""
        fixed = self._sizes()
        rest = math.prod(s for s in fixed.values())
        if world % rest:
            raise MeshError(f"{type(self).__name__}: {world} ranks do not divide into "
                            f"{' x '.join(f'{k}={s}' for k, s in fixed.items())}; launch a "
                            f"multiple of {rest} processes")
        return {a: (world // rest if a == "dp" else s) for a, s in self._order(fixed).items()}

    def _order(self, fixed: dict) -> dict:
        return {"dp": None, **fixed}

    @property
    def mesh(self):
        """The mesh over the launched ranks (``launch_from_torch`` first)."""
        import torch.distributed as dist

        from ..core.mesh import Mesh

        if self._mesh is None:
            if not dist.is_initialized():
                raise MeshError(f"{type(self).__name__}.mesh: no process group; call "
                                f"meshlab.booster.launch_from_torch() first (or plan with "
                                f"Booster(plugin=...).plan(model, world_size=N))")
            self._mesh = Mesh(self.mesh_shape(dist.get_world_size()))
        return self._mesh

    # -- Colossal-AI's plugin API ------------------------------------------------------
    def prepare_dataloader(self, dataset, batch_size: int, shuffle: bool = False,
                           seed: int = 1024, drop_last: bool = False, pin_memory: bool = False,
                           num_workers: int = 0, distributed_sampler_cls=None, **kwargs):
        """A DataLoader of ``batch_size`` samples per data-parallel rank (Colossal-AI's
        convention; ``meshlab.dataloader`` takes the global batch): data-parallel ranks
        get distinct samples, tensor/pipeline/sequence peers the same ones."""
        from ..train.data import dataloader
        from ..core.errors import check_int

        check_int(batch_size, "prepare_dataloader", "batch_size", example=8)
        if distributed_sampler_cls is not None:
            raise UnsupportedArgument("prepare_dataloader", "distributed_sampler_cls",
                                      distributed_sampler_cls, "meshlab's sampler splits by "
                                      "the data axes of the mesh", "meshlab.dataloader(...)")
        dp = math.prod(self.mesh.axis_size(a) for a in self._stack.data_axes)
        return dataloader(dataset, self.mesh, batch_size * dp, axes=self._stack.data_axes,
                          shuffle=shuffle, seed=seed, drop_last=drop_last,
                          pin_memory=pin_memory, num_workers=num_workers, **kwargs)

    # -- the mesh as Colossal-AI scripts read it (``_stages``) -------------------------
    @property
    def stage_manager(self):
        """This rank's pipeline stage (None without a ``pp`` axis)."""
        from ._stages import stage_manager

        return stage_manager(self)

    @property
    def pg_mesh(self):
        """The mesh over the launched ranks as Colossal-AI's ``ProcessGroupMesh``
        (``.mesh`` is meshlab's)."""
        from .cluster import ProcessGroupMesh

        return ProcessGroupMesh(self.mesh)

    @property
    def dp_group(self):
        from ._stages import data_group

        return data_group(self)

    @property
    def tp_group(self):
        from ._stages import axis_group

        return axis_group(self, "tp")

    @property
    def pp_group(self):
        from ._stages import axis_group

        return axis_group(self, "pp")

    @property
    def sp_group(self):
        from ._stages import axis_group

        return axis_group(self, "sp")

    def support_no_sync(self) -> bool:
        return True

    def support_lora(self) -> bool:
        return True

    def control_precision(self) -> bool:
        return self.controls_precision

    def __getattr__(self, name: str):
        """Colossal-AI's plugin attributes: every argument (``plugin.pp_size``) and
        ``dp_size`` (the data-parallel ranks of the launched world)."""
        args = self.__dict__.get("arguments")
        if args is not None and name in args:
            return args[name]
        if name == "dp_size" and args is not None:
            return math.prod(self.mesh.axis_size(a) for a in self._stack.data_axes)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        given = [f"{a.name}={self.arguments[a.name]!r}" for a in self.ARGS
                 if self.arguments[a.name] is not a.default
                 and self.arguments[a.name] != a.default]
        return f"{type(self).__name__}({', '.join(given)})"
