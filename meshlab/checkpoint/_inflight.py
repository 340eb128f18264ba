"""The asynchronous save in flight, and the group its background thread talks on.

At most one save runs in the background; every checkpoint call first waits for it
(``wait``), so a load never reads a directory still being written and two saves never
interleave. The background thread has a gloo group of its own: the control group
carries every step's agreement on the main thread meanwhile, and two threads must never
interleave collectives on one group.
"""

from __future__ import annotations

import dataclasses
import threading

import torch.distributed as dist

from ._ranks import ctrl_group, distributed


@dataclasses.dataclass
class Pending:
    thread: threading.Thread
    error: list

    def wait(self) -> None:
        self.thread.join()
        if self.error:
            raise self.error[0]


IN_FLIGHT: list[Pending] = []
_BACKGROUND: dict[int, tuple] = {}


def wait() -> None:
    """Block until the asynchronous save in flight (if any) is committed; raises its
    ``CheckpointError`` (on every rank) if it failed."""
    while IN_FLIGHT:
        IN_FLIGHT.pop().wait()


def background_group(model):
    """The background save thread's group: made once per control group, by every rank
    (save is collective, so every rank reaches this call in the same order)."""
    if not distributed():
        return None
    ctrl = ctrl_group(model)
    if dist.get_backend(ctrl) == "fake":
        return ctrl
    hit = _BACKGROUND.get(id(ctrl))
    if hit is None or hit[0] is not ctrl:      # the group object is kept: ids stay unique
        hit = _BACKGROUND[id(ctrl)] = (ctrl, dist.new_group(backend="gloo"))
    return hit[1]
