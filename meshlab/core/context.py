"""The ambient mesh and rules (``with mesh:`` / ``with rules:``), as JAX's ``use_mesh``, and
the layout of the parallelized forward running now (``constrain`` and ``shard_map`` read
it)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

# Annotations name ``Mesh`` (meshlab.core.mesh) and ``Rules`` (meshlab.core.rules) without
# importing them: the mesh module imports this one to enter its context.

_MESH: contextvars.ContextVar["Mesh | None"] = contextvars.ContextVar("meshlab_mesh", default=None)
_RULES: contextvars.ContextVar["Rules | None"] = contextvars.ContextVar("meshlab_rules", default=None)


def current_mesh() -> "Mesh | None":
    return _MESH.get()


def current_rules() -> "Rules | None":
    return _RULES.get()


@contextlib.contextmanager
def use_mesh(mesh: "Mesh", rules: "Rules | None" = None) -> Iterator["Mesh"]:
    """Make ``mesh`` (and optionally ``rules``) ambient for the block."""
    tm = _MESH.set(mesh)
    tr = _RULES.set(rules) if rules is not None else None
    try:
        yield mesh
    finally:
        if tr is not None:
            _RULES.reset(tr)
        _MESH.reset(tm)


@contextlib.contextmanager
def use_rules(rules: "Rules") -> Iterator["Rules"]:
    """Make ``rules`` ambient: logical specs in ``constrain`` resolve through them."""
    t = _RULES.set(rules)
    try:
        yield rules
    finally:
        _RULES.reset(t)


# -- the layout a parallelized model's forward runs under --------------------------------
@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What ``constrain`` and ``shard_map`` need to know inside a parallelized forward.

    ``mesh`` and ``rules`` are the plan's: spec names are checked against the whole mesh.
    ``data_axes`` carry data parallelism: the data loader already split the batch (dim 0)
    over them, so a spec may name them on dim 0 only, where they are already true.
    ``tp_mesh`` is the DeviceMesh of the tensor-parallel axis when the model runs on
    DTensors (DTensor mode); None on the local-shard path, where activations are plain
    local tensors.
    """

    mesh: "Mesh"
    rules: "Rules | None"
    data_axes: tuple[str, ...]
    tp_axis: str
    tp_mesh: Any = None

    @property
    def dtensor(self) -> bool:
        return self.tp_mesh is not None


_LAYOUT: contextvars.ContextVar["ModelLayout | None"] = contextvars.ContextVar(
    "meshlab_model_layout", default=None)
_BY_MESH: dict = {}          # tp DeviceMesh -> ModelLayout (DTensor mode)
_LOCAL = contextvars.ContextVar("meshlab_local_region", default=False)


def current_layout() -> "ModelLayout | None":
    """The layout of the parallelized forward running now, or None."""
    return _LAYOUT.get()


def enter_layout(layout: "ModelLayout"):
    """Mark the start of a parallelized forward (a root pre-hook); returns the token
    ``exit_layout`` takes."""
    return _LAYOUT.set(layout)


def exit_layout(token) -> None:
    _LAYOUT.reset(token)


def register_layout(layout: "ModelLayout") -> None:
    """Remember a DTensor-mode layout by its tensor-parallel DeviceMesh, so a DTensor
    met outside the root forward (a block recomputed in the backward) still resolves
    its specs against the whole mesh."""
    _BY_MESH[layout.tp_mesh] = layout


def layout_of_mesh(device_mesh) -> "ModelLayout | None":
    try:
        return _BY_MESH.get(device_mesh)
    except TypeError:        # an unhashable mesh is none of ours
        return None


@contextlib.contextmanager
def local_region() -> Iterator[None]:
    """Code that runs on local shards (``shard_map``'s body): plain tensors there are
    this rank's blocks, never to be read as replicated DTensors."""
    t = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(t)


def in_local_region() -> bool:
    return _LOCAL.get()
