"""Buffers a training forward changes, watched forward by forward, for a room whose own
schedule runs the microbatches' forwards (the pipeline's) and cannot stop between them
(``train._buffers`` watches the step's own microbatches).

:class:`ForwardWatch` hooks each stage's forward and compares a buffer's value after every
forward that changes it with its value after the first; the room raises what it found on
every rank once the schedule is done, before the optimizer's step: a buffer updated once
per microbatch (where one process updates it once a step), or one whose copies differ
between data-parallel replicas (each updated from its own share of the batch).
"""

from __future__ import annotations

import functools

from ..core.digest import digests, shard_key
from ..core.errors import ConfigError

REPLICA_FIX = ("each data-parallel rank updated it from its own share of the batch, where "
               "one process updates it from the whole batch; update it from the whole "
               "batch (its statistics all-reduced over the data axes, as meshlab does for "
               "BatchNorm), or outside the training forward, or run the module in "
               "evaluation mode (module.eval())")


def versions(module) -> dict:
    """Each buffer of ``module`` by name: (its identity, its version counter)."""
    return {n: (id(b), b._version) for n, b in module.named_buffers()}


def changed(module, before: dict) -> list:
    """(name, buffer) of each buffer of ``module`` written or replaced since ``before``
    (:func:`versions`)."""
    return [(n, b) for n, b in module.named_buffers() if before.get(n) != (id(b), b._version)]


def again_error(what: str, name: str, when: str, fix: str) -> ConfigError:
    """A buffer updated in more than one microbatch's forward (again in ``when``), where
    one process's step over the whole batch updates it once."""
    return ConfigError(f"{what}: buffer {name!r} changed again in {when}: it is updated once "
                       f"per microbatch, where one step over the whole batch updates it "
                       f"once; {fix}")


class ForwardWatch:
    """The buffers each forward of some modules changes, for a schedule that runs the
    microbatches' forwards itself: ``modules`` is ``(where, module)`` pairs (``where``, a
    pipeline stage's name, tells apart the copies of a buffer that the ranks compare);
    ``names`` the model's name of each buffer by identity (else the module's own name);
    ``skip_first``: each module's first forward is not counted (a schedule's setup)."""

    def __init__(self, modules, names=None, skip_first: bool = False) -> None:
        self.names = names or {}     # id(buffer) -> its name in the model
        self._skip = {where for where, _ in modules} if skip_first else set()
        self.first: dict[str, tuple] = {}     # name -> (where, buffer, digest)
        self.again: list[str] = []
        self._before: dict[str, dict] = {}
        self._hooks = []
        for where, m in modules:
            self._hooks += [m.register_forward_pre_hook(functools.partial(self._pre, where)),
                            m.register_forward_hook(functools.partial(self._post, where))]

    def _pre(self, where, module, args) -> None:
        if where in self._skip:
            return
        self._before[where] = versions(module)

    def _post(self, where, module, args, out) -> None:
        if where in self._skip:         # the schedule's setup forward, undone by its room
            self._skip.discard(where)
            return
        now = [(self.names.get(id(b), n), b)
               for n, b in changed(module, self._before.pop(where, {}))]
        for (n, b), d in zip(now, digests(b for _, b in now)):
            if n not in self.first:
                self.first[n] = (where, b, d)
            elif self.first[n][2] != d and n not in self.again:
                self.again.append(n)

    def finish(self, what: str) -> tuple:
        """(the error of a buffer changed again in a later forward, or None; ``agree``'s
        ``peers`` comparing each changed buffer among the ranks that hold its copy); the
        hooks removed."""
        for h in self._hooks:
            h.remove()
        error = None if not self.again else again_error(
            what, self.again[0], "a later microbatch's forward",
            "update it outside the training forward, or run its module in evaluation mode "
            "(module.eval())")
        peers = {f"buffer {n}": (f"{where}, {shard_key(b)}", d, REPLICA_FIX)
                 for n, (where, b, d) in self.first.items()}
        return error, peers
