"""Atomic replacement of a checkpoint directory, and finding the committed one after a
crash at any point.

A new checkpoint ``P`` is written whole into ``P.partial``; committing it is three
renames, each atomic, with the parent directory synced after each:

1. an existing ``P`` is renamed to ``P.old`` (set aside, still whole);
2. ``P.partial`` is renamed to ``P``;
3. ``P.old`` is discarded: renamed to ``P.old.trash`` first, then deleted, so a
   half-deleted directory never carries a name that is read.

The committed checkpoint called ``P`` is therefore ``P`` if it is complete, else ``P.old``
if that is (a crash between steps 1 and 2), else none; ``resolve`` answers that without
changing anything (every rank may call it at once). ``recover`` (rank 0, before a save)
puts a crashed directory back in order: it renames ``P.old`` back to ``P`` if that is
the committed one and deletes leftovers. Each of its steps keeps ``resolve``'s answer.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Callable

SUFFIXES = (".partial", ".old")      # names that belong to a checkpoint being replaced
TRASH = ".trash"                     # a directory being deleted: never read


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` so that ``path`` holds either its old content or the whole new one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve(path: str, committed: Callable[[str], bool]) -> str | None:
    """The directory holding the committed checkpoint called ``path`` (``path`` itself or
    ``path.old``), or None; changes nothing."""
    if committed(path):
        return path
    if committed(path + ".old"):
        return path + ".old"
    return None


def discard(path: str) -> None:
    """Delete directory ``path``; a crash meanwhile leaves only ``path.trash``."""
    if not os.path.lexists(path):
        return
    trash = path + TRASH
    if os.path.lexists(trash):
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


def recover(path: str, committed: Callable[[str], bool]) -> None:
    """Undo what a crashed save left (rank 0 only): the committed checkpoint ends up at
    ``path`` (or there is none), and no ``.partial``, ``.old`` or ``.trash`` remains."""
    old = path + ".old"
    if not committed(path) and committed(old):
        discard(path)                       # an uncommitted leftover, if any
        os.rename(old, path)
        fsync_dir(_parent(path))
    for leftover in (old, path + ".partial"):
        discard(leftover)
    for leftover in (path + TRASH, old + TRASH, path + ".partial" + TRASH):
        if os.path.lexists(leftover):
            shutil.rmtree(leftover)


def commit(tmp: str, path: str) -> None:
    """Move the finished ``tmp`` to ``path``, replacing what is there (rank 0 only, after
    ``recover``): at every instant ``resolve(path)`` is the old or the new checkpoint."""
    old = path + ".old"
    parent = _parent(path)
    if os.path.lexists(path):
        discard(old)                        # after recover: never the committed one
        os.rename(path, old)
        fsync_dir(parent)
    os.rename(tmp, path)
    fsync_dir(parent)
    try:                                    # committed: a leftover is no failure
        discard(old)
    except OSError as e:
        warnings.warn(f"{old} could not be deleted ({e}); the next save to {path} deletes "
                      f"it", stacklevel=3)


def base_names(directory: str) -> list[str]:
    """The checkpoint names under ``directory``: ``x``, ``x.old`` and ``x.partial`` all
    name ``x``; ``*.trash`` (being deleted) names nothing."""
    out = set()
    for name in os.listdir(directory):
        if name.endswith(TRASH):
            continue
        for s in SUFFIXES:
            if name.endswith(s):
                name = name[:-len(s)]
                break
        out.add(name)
    return sorted(out)
