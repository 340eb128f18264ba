"""Small tensor helpers shared by the runtime, checkpoints and ops (no plan, no mesh)."""

from __future__ import annotations


def local(t):
    """The local shard of a DTensor; any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
