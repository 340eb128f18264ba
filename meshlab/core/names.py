"""Dotted module names: the modules a name lies under, and which of them is a block."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1 << 16)
def ancestors(fqn: str) -> tuple[str, ...]:
    """``'a.b.c'`` -> ``('a', 'a.b')``: the modules ``fqn`` lies under, outermost first
    (remembered: planning asks it for the same names once per layout and pipeline stage)."""
    parts = fqn.split(".")
    return tuple(".".join(parts[:i]) for i in range(1, len(parts)))


def owner(fqn: str, names) -> str | None:
    """The outermost of ``fqn``'s ancestors that is in ``names`` (a set or dict of module
    names: blocks, regions), or None; looked up by ancestor, so asking it for every
    parameter stays linear in the number of names."""
    return next((a for a in ancestors(fqn) if a in names), None)
