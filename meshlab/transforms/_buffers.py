"""Buffers a training forward changes, watched forward by forward, for a room whose own
schedule runs the microbatches' forwards (the pipeline's) and cannot stop between them
(``train._buffers`` watches the step's own microbatches).

:class:`ForwardWatch` hooks each stage's forward and compares a buffer's value after every
forward that changes it with its value after the first; the room raises what it found on
every rank once the schedule is done, before the optimizer's step: a buffer updated once
per microbatch (where one process updates it once a step), or one whose copies differ
between data-parallel replicas (each updated from its own share of the batch).

:class:`ParamWrites` finds the parameters a forward writes in place, for the step's watch
and this one: where the batch is cut, such a write is never the single process's, so it
is refused (``PIPELINE_WHY`` says why for a pipeline, ``train._buffers`` for the step).

:class:`FirstForward` watches the first training forward of a whole model called by hand
over data-parallel ranks (a plain loop, a boosted model's ``model(**batch)``), where no
step cuts the batch: ``apply.materialize`` has the ranks compare what it found.
"""

from __future__ import annotations

import functools

from torch import nn

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


PARAM_FIX = ("initialize it before ml.parallelize (run its data-dependent initialization "
             "on one process, e.g. one forward over a batch, then parallelize), or "
             "compute it outside the training forward")


PIPELINE_WHY = ("of a pipeline stage: each microbatch's forward writes it (and the schedule's "
                "setup forward, past the first stage on uninitialized tensors), where one "
                "process writes it from the whole batch")


def _written(before: dict, named) -> list:
    """(name, tensor) of each of ``named`` that is the tensor ``before`` holds for its
    name ((identity, version)) at a later version: written in place. Another tensor under
    the name is not a write (FSDP2 registers its gathered copies for the forward, and
    without resharding after it leaves them registered)."""
    out = []
    for n, p in named:
        was = before.get(n)
        if was is not None and was[0] == id(p) and was[1] != p._version:
            out.append((n, p))
    return out


class ParamWrites:
    """The parameters written in place by one forward of ``model``: each one this rank
    holds, by identity and version before and after (see :meth:`done`), and, through
    hooks on each FSDP2 unit, the gathered copies FSDP registers for the unit's forward.
    The unit's pre-hook runs after FSDP's (which gathers) and its post-hook before FSDP's
    (which drops the copies). Only FSDP units are hooked: fused projections take their
    fused path only on modules without hooks (``fuse._residual``), and a checkpointed
    block recomputed on the other path would not save the same tensors.

    A compiled block (``compile_blocks``) runs this one forward eagerly, its compiled call
    put back by :meth:`close`: a graph traces a write to FSDP's gathered copy as any other
    and no hook runs inside it, so the write would be lost unseen. The block compiles at
    the next forward."""

    def __init__(self, model: nn.Module, names=None) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.model = model
        self.names = names or {}     # id(parameter) -> its name in the model
        self.before = {n: (id(p), p._version) for n, p in model.named_parameters()}
        self.gathered: list[str] = []
        self._seen: dict[str, dict] = {}
        self._hooks = []
        self._compiled = [(m, m._compiled_call_impl) for m in model.modules()
                          if getattr(m, "_compiled_call_impl", None) is not None]
        for m, _ in self._compiled:
            m._compiled_call_impl = None
        for name, m in model.named_modules():
            if isinstance(m, FSDPModule):
                self._hooks += [
                    m.register_forward_pre_hook(functools.partial(self._pre, name)),
                    m.register_forward_hook(functools.partial(self._post, name),
                                            prepend=True)]

    def _pre(self, name, module, args) -> None:
        self._seen[name] = {k: (id(p), p._version) for k, p in module.named_parameters()}

    def _post(self, name, module, args, out) -> None:
        for k, p in _written(self._seen.pop(name, {}), module.named_parameters()):
            full = self.names.get(id(p), f"{name}.{k}" if name else k)
            if full not in self.gathered:
                self.gathered.append(full)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m, call in self._compiled:
            m._compiled_call_impl = call
        self._compiled = []

    def done(self, what: str, why: str) -> ConfigError | None:
        """The hooks removed; the error naming the first parameter the forward wrote
        (``why`` says why a parameter written in place is not exact there), or None."""
        self.close()
        written = [self.names.get(id(p), n)
                   for n, p in _written(self.before, self.model.named_parameters())]
        lost = [n for n in self.gathered if n not in written]
        if lost:
            return ConfigError(
                f"{what}: parameter {lost[0]!r} is written in the training forward, to the "
                f"copy zero_shard (FSDP) gathers for the forward and drops after it: the "
                f"write is lost, where one process keeps it; {PARAM_FIX}")
        if written:
            return ConfigError(f"{what}: parameter {written[0]!r} is written in the "
                               f"training forward {why}; {PARAM_FIX}")
        return None


DP_WHY = ("over data-parallel ranks: each rank sets it from its own share of the batch, "
          "where one process sets it from the whole batch")


class FirstForward:
    """One training forward of a whole parallelized model, called by hand over
    data-parallel ranks: the buffers it changed and the parameters it wrote
    (:meth:`finish`). A step (``train._buffers``) and a pipeline (:class:`ForwardWatch`)
    watch their own forwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.before = versions(model)
        self.params = ParamWrites(model)

    def close(self) -> None:
        self.params.close()

    def finish(self, what: str) -> tuple:
        """(the error of a parameter the forward wrote, or None; ``agree``'s ``peers``
        comparing each buffer it changed among the ranks that hold the same copy); the
        hooks removed."""
        error = self.params.done(what, DP_WHY)
        now = changed(self.model, self.before)
        peers = {f"buffer {n}": (shard_key(b), d, REPLICA_FIX)
                 for (n, b), d in zip(now, digests(b for _, b in now))}
        return error, peers


class ForwardWatch:
    """The buffers each forward of some modules changes, for a schedule that runs the
    microbatches' forwards itself: ``modules`` is ``(where, module)`` pairs (``where``, a
    pipeline stage's name, tells apart the copies of a buffer that the ranks compare);
    ``names`` the model's name of each buffer and parameter by identity (else the
    module's own name); ``skip_first``: each module's first forward is not counted (a
    schedule's setup)."""

    def __init__(self, modules, names=None, skip_first: bool = False) -> None:
        self.names = names or {}     # id(buffer or parameter) -> its name in the model
        self._skip = {where for where, _ in modules} if skip_first else set()
        self.first: dict[str, tuple] = {}     # name -> (where, buffer, digest)
        self.again: list[str] = []
        self._before: dict[str, dict] = {}
        self._hooks = []
        self.params = [ParamWrites(m, self.names) for _, m in modules]
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
        written = [w.done(what, PIPELINE_WHY) for w in self.params]
        error = next((e for e in written if e is not None), None)
        if error is None and self.again:
            error = again_error(
                what, self.again[0], "a later microbatch's forward",
                "update it outside the training forward, or run its module in evaluation "
                "mode (module.eval())")
        peers = {f"buffer {n}": (f"{where}, {shard_key(b)}", d, REPLICA_FIX)
                 for n, (where, b, d) in self.first.items()}
        return error, peers
