"""The ambient mesh and rules (``with mesh:`` / ``with rules:``), as JAX's ``use_mesh``."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, TYPE_CHECKING

if TYPE_CHECKING:
    from ._mesh import Mesh
    from ._rules import Rules

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
