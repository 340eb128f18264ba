"""What ``materialize`` hands each room's ``prepare`` and ``install``, and what the
parallelized model keeps: ``Install`` (the model being changed, the bound plan, process
groups by axis name) and ``Runtime`` (the plan, the mesh and every room's ``Part``)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable

import torch
from torch import nn

from ..core.errors import ConfigError
from ..core.mesh import Mesh
from ..planning.plan import Plan
from ..planning.roles import AxisRoles


def axes_mesh(mesh: Mesh, axes: tuple[str, ...]):
    """The DeviceMesh over ``axes`` of ``mesh`` (several axes flattened into one)."""
    dm = mesh.device_mesh
    if len(axes) == 1:
        return dm[axes[0]]
    order = [mesh.axis_names.index(a) for a in axes if a in mesh.axis_names]
    if len(order) == len(axes) and order != sorted(order):
        mine = tuple(a for a in mesh.axis_names if a in axes)
        raise ConfigError(
            f"axes {axes} of the mesh {mesh.shape} are named in "
            f"another order than the mesh lists them ({mine}): a DeviceMesh flattens axes "
            f"only in the mesh's order. Name them as {mine}, or build the Mesh with its axes "
            f"in the order {axes}")
    return dm[axes]._flatten("_".join(axes))


def shared_module(model: nn.Module | None, blocks=()) -> tuple[str, str] | None:
    """The first module with parameters of its own that the model holds under two names
    in different ``blocks`` (one module object placed in two blocks, or in a block and
    outside every block), as ``(first name, second name)``; None if none (or no model).
    Placed twice outside the blocks (T5's shared embedding, its encoder's and its
    decoder's), or parameters shared between two modules (tied embeddings), is not this."""
    if model is None:
        return None

    def block(name: str) -> str:
        return next((b for b in blocks if name == b or name.startswith(b + ".")), "")
    seen: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if next(m.parameters(recurse=False), None) is None:
            continue
        first = seen.setdefault(id(m), name)
        if block(first) != block(name):
            return first, name
    return None


def mesh_device(mesh: Mesh) -> torch.device:
    """The device this rank computes on: its CUDA device, or the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class _Groups:
    """Process groups by mesh axis name (several names: the flattened axis)."""

    mesh: Mesh
    plan: Plan

    @property
    def roles(self) -> AxisRoles:
        return self.plan.roles

    def device_mesh(self, *axes: str):
        return axes_mesh(self.mesh, tuple(axes))

    def group(self, *axes: str):
        # a group's members do not depend on the order of its axes: take the mesh's order
        # (data axes are listed as the plan found them, which need not be the mesh's)
        names = self.mesh.axis_names
        if all(a in names for a in axes):
            axes = tuple(sorted(axes, key=names.index))
        return self.device_mesh(*axes).get_group()

    def size(self, *axes: str) -> int:
        import math

        return math.prod(self.mesh.axis_size(a) for a in axes) if axes else 1

    def coordinate(self, axis: str) -> int:
        return self.mesh.coordinate(self.mesh.rank)[axis]

    @property
    def device(self) -> torch.device:
        """This rank's device; small reduced values (losses, norms, overflow flags) live
        there too, since an NCCL-only group cannot reduce CPU tensors."""
        return mesh_device(self.mesh)

    @property
    def dp_group(self):
        """The group over every axis whose ranks read different batches (``roles.data``)."""
        return self.group(*self.roles.data) if self.roles.data else None

    @property
    def dp_size(self) -> int:
        return self.size(*self.roles.data)

    @property
    def tp_group(self):
        return self.group(self.roles.tp) if self.roles.tp else None

    @property
    def tp_size(self) -> int:
        return self.size(*self.roles.axes("tp"))


@dataclasses.dataclass(frozen=True)
class EagerModules:
    """Modules a room runs outside every compiled graph, and why (the expert dispatch: its
    all-to-all's split sizes are read on the host from the routing). ``compile_blocks``
    compiles the rest of each block around them, as torchtitan compiles a mixture-of-experts
    block's other modules."""

    fqns: frozenset
    why: str


@dataclasses.dataclass
class StageRoots:
    """The model's forward runs in stage modules a room builds at its install
    (``pipeline``), never through the model's own forward. A room that wraps the root of
    the forward (FSDP2's root unit under ``zero_shard(2)`` / ``zero_shard(3)``) adds a
    ``wrap`` here instead, and the stage room calls every wrap on each stage module it
    builds, before the stage runs (torchtitan's PP x FSDP2 layout: each stage is an FSDP2
    root over its own blocks' units)."""

    wraps: list[Callable[[nn.Module], None]] = dataclasses.field(default_factory=list)

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` (a stage) after every wrap a room added, in the order added."""
        for w in self.wraps:
            w(module)
        return module


@dataclasses.dataclass
class Install(_Groups):
    """The state of one ``materialize``: rooms read and extend it in phase order."""

    model: nn.Module
    plan: Plan
    mesh: Mesh
    ctrl_group: object
    on_module: list[Callable[[str, nn.Module], None]] = dataclasses.field(default_factory=list)
    dropped: set[str] = dataclasses.field(default_factory=set)  # blocks run by other ranks
    after_init: list[Callable[[nn.Module], None]] = dataclasses.field(default_factory=list)
    parts: list = dataclasses.field(default_factory=list)
    # Typed values a room's ``prepare`` leaves for its own ``install`` (or for a room
    # installed later), one per type: ``keep(value)``, ``kept(cls)``.
    _kept: dict = dataclasses.field(default_factory=dict, repr=False)

    def part(self, cls: type):
        return next((p for p in self.parts if isinstance(p, cls)), None)

    def keep(self, value) -> None:
        """Keep ``value`` for a later step of this materialize, found by its type."""
        if type(value) in self._kept:
            raise ConfigError(f"materialize: a {type(value).__name__} is kept already; each "
                              f"type is kept once per install (two rooms of one kind?)")
        self._kept[type(value)] = value

    def kept(self, cls: type):
        """The value of type ``cls`` a ``prepare`` kept, or None."""
        return self._kept.get(cls)


@dataclasses.dataclass
class Runtime(_Groups):
    """What a parallelized model carries for ``optimizer``, ``step`` and checkpoints."""

    plan: Plan
    mesh: Mesh
    parts: tuple
    ctrl_group: object     # gloo group for checkpoint agreement and barriers
    grad_sync: object = None   # ``GradSync``: the reductions the backward runs

    def __deepcopy__(self, memo: dict):
        from ..core.errors import ConfigError

        raise ConfigError(
            "copy.deepcopy of a parallelized model: its hooks, process groups and sharded "
            "parameters belong to this model, and a copy would run them on the original's "
            "state. Keep a copy of its weights instead ({n: p.full_tensor() if hasattr(p, "
            "'full_tensor') else p.detach().clone() for n, p in model.named_parameters()}), "
            "deep-copy the model before parallelize (or boost), or build and parallelize "
            "a second model")

    def part(self, cls: type):
        """The installed part of type ``cls``, or None."""
        return next((p for p in self.parts if isinstance(p, cls)), None)

    def autocast(self):
        """The context every forward runs in (``precision``'s autocast, or none)."""
        for p in self.parts:
            ctx = p.compute_context(self.parts)
            if ctx is not None:
                return ctx
        return contextlib.nullcontext()

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Whether the next backward synchronizes gradients (off: they accumulate
        locally, as under DDP's ``no_sync``)."""
        if self.grad_sync is not None:
            self.grad_sync.enabled = enabled
        for p in self.parts:
            p.set_gradient_sync(model, enabled)

    @property
    def sync_parts(self) -> tuple:
        return tuple(sorted(self.parts, key=lambda p: p.order))


# The runtime rides on the model it runs, under this one attribute, set and read only here.
def attach_runtime(model: nn.Module, rt: Runtime) -> None:
    """Give a materialized model its ``Runtime`` (``materialize``'s last step), first in
    the model's ``__dict__``: ``copy.deepcopy`` copies a module's attributes in that
    order, so it meets the runtime's refusal (``Runtime.__deepcopy__``) before the
    process groups and FSDP2 state it could not copy."""
    rest = dict(model.__dict__)
    model.__dict__.clear()
    model.__dict__["_meshlab"] = rt
    model.__dict__.update((k, v) for k, v in rest.items() if k != "_meshlab")


def runtime_or_none(model: nn.Module) -> Runtime | None:
    """The ``Runtime`` of a model ``parallelize`` ran, or None for any other model."""
    return getattr(model, "_meshlab", None)


def runtime_of(model: nn.Module) -> Runtime:
    """The ``Runtime`` of a model ``parallelize`` ran; ``ConfigError`` for any other."""
    rt = runtime_or_none(model)
    if rt is None:
        raise ConfigError("this model was not parallelized by meshlab; call "
                          "meshlab.parallelize(model, spec, mesh) first")
    return rt


# A room that gives a module an instance ``forward`` computing the module's own math
# another way (fuse's query projection computing the key and value products with its own)
# says how to take it back; a room that must replace the module with another
# (``precision('fp8')``'s float8 layers) then takes it back instead of losing the call.
_CHECKPOINTED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def mark_checkpointed(module: nn.Module) -> None:
    """Record that ``module``'s forward runs under activation checkpointing (remat)."""
    _CHECKPOINTED.add(module)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`mark_checkpointed` recorded ``module``."""
    return module in _CHECKPOINTED


def restorable_forward(module: nn.Module, restore: Callable[[], None]) -> None:
    """Mark ``module``'s instance ``forward`` as one ``restore()`` removes."""
    module._meshlab_restore_forward = restore


def forget_restore(module: nn.Module) -> None:
    """Drop the mark :func:`restorable_forward` set (the forward was taken back)."""
    vars(module).pop("_meshlab_restore_forward", None)


def restore_forward(module: nn.Module) -> bool:
    """Take back ``module``'s marked instance ``forward`` (every module its room changed
    with it); False where none is marked."""
    restore = vars(module).get("_meshlab_restore_forward")
    if restore is None:
        return False
    restore()
    return True

