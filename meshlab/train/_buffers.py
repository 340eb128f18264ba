"""Buffers a training forward changes, where the step cuts the batch.

A module that updates a buffer from its input in the training forward (a running mean of
its own, a counter of the batches seen) updates it, on one process, once a step from the
whole batch. Cut over data-parallel ranks, each rank updates it from its share: the
replicas' buffers then differ from each other and from the single process, and every
later output with them, without an error. Cut into microbatches, it is updated once per
microbatch. meshlab computes BatchNorm's statistics over the whole batch and averages an
InstanceNorm's running statistics (``transforms.zero._batchnorm``); it cannot know how to
do that for a module of its own.

So on a model's first training step that cuts the batch, the step watches its buffers:
after the first microbatch's forward, each buffer that changed (in place, or replaced) is
compared among the ranks that hold the same copy of it (``agree``'s ``peers``, a digest
each); after the second microbatch's, against its value after the first. A buffer that
differs between replicas, or changes again in the next microbatch, stops every rank with
an error naming it, before the step's first backward. A buffer every rank updates alike
and once (transformers' dynamic rotary frequencies, which follow the sequence length)
trains on. Later steps are not watched: the first shows how the forward treats them.

A parameter that the training forward writes (a data-dependent initialization, as Glow's
ActNorm sets its scale from the first batch's statistics) is refused on that step: each
replica would set it from its own share of the batch and the replicas then train apart,
and under ``zero_shard`` the forward writes the gathered copy, which FSDP drops after the
forward, so the write is lost. Neither says so. The parameters this rank holds are
compared before and after the first microbatch's forward (their identity and version
counter), and each FSDP2 unit is hooked for that forward, so that a write to a gathered
copy is seen before the copy is dropped (``transforms._buffers.ParamWrites``; a unit
inside a compiled block is not hooked, its hooks would be compiled with it).

A room whose own schedule runs the microbatches' forwards (the pipeline's) cannot stop
between them: it watches with ``transforms._buffers.ForwardWatch`` instead.
"""

from __future__ import annotations

from torch import nn

from ..core.agree import agree, alone
from ..core.digest import digests, shard_key
from ..transforms._buffers import REPLICA_FIX, ParamWrites, again_error, changed, versions


class BufferWatch:
    """The model's buffers before a training step's first forward (identity and version
    of each), and their digests after it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.before = versions(model)
        self.first: dict[str, str] = {}
        self.params: ParamWrites | None = ParamWrites(model)

    def close(self) -> None:
        """The parameter hooks removed (a forward that raised leaves them)."""
        if self.params is not None:
            self.params.close()

    def check(self, rt, index: int) -> None:
        """After microbatch ``index``'s forward (0 or 1): every rank raises, naming the
        buffer, where one differs between replicas (after the first) or changed again
        (after the second). Collective over the control group: every rank calls it."""
        now = changed(self.model, self.before)
        error = None
        if self.params is not None:
            error, self.params = self.params.done(
                "step", "of a step that cuts the batch: each data-parallel rank (or each "
                "microbatch) sets it from its own share, where one process sets it from "
                "the whole batch"), None
        if index == 0:
            self.first = dict(zip((n for n, _ in now), digests(b for _, b in now)))
        else:
            again = [n for (n, _), d in zip(now, digests(b for _, b in now))
                     if self.first.get(n, d) != d]
            if again and error is None:
                error = again_error("step(microbatches=...)", again[0],
                                    "the second microbatch's forward",
                                    "use microbatches=1, or update it outside the training "
                                    "forward")
        peers = {f"buffer {n}": (shard_key(b), self.first[n], REPLICA_FIX)
                 for n, b in now if n in self.first} if index == 0 else {}
        if alone(rt.ctrl_group):
            if error is not None:
                raise error
            return
        agree(rt.ctrl_group, f"step: buffers after microbatch {index}'s forward",
              error=error, peers=peers)


def watch(model: nn.Module, rt, microbatches: int) -> BufferWatch | None:
    """A watch for this training step: the model's first that cuts the batch (over more
    than one data-parallel rank, or into microbatches), once; else None."""
    if getattr(rt, "_buffers_watched", False) or (rt.dp_size <= 1 and microbatches <= 1):
        return None
    rt._buffers_watched = True
    return BufferWatch(model)
