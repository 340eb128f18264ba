"""A stage that raises keeps the schedule's communication going; the step then fails on
every rank together.

The stages run on different ranks and wait for each other point to point: a stage whose
forward raises (a bad batch, a hook) and leaves the schedule would leave the next stage
waiting in its receive for good, and the previous one in its send. So the exception is
caught where the stage runs: the stage hands on a stand-in of the shape the next stage
expects (zeros, joined to its input so the backward runs and sends zeros back), the last
stage's loss of that microbatch is zero, the schedule completes on every rank, and at its
end every rank agrees (``core.agree``): the failed rank raises its own error, the others
``PeerError`` naming it, and no rank applies the step's gradients.
"""

from __future__ import annotations

import torch

from ...core.digest import local
from ...core.errors import ConfigError


class StageFailures:
    """The first exception a stage of this rank raised in the schedule running now."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.stand_ins: set[int] = set()     # ids of the outputs that stand in for one

    def record(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def take(self) -> BaseException | None:
        """The exception (None if none), forgotten here: the next schedule starts clean."""
        error, self.error = self.error, None
        self.stand_ins.clear()
        return error


def stand_in(x: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """What a failed stage hands on for input ``x``: zeros of the hidden states' shape,
    joined to ``x`` where it carries a gradient (a received activation, whose gradient the
    backward sends back), else a leaf that takes one."""
    if x.is_floating_point():
        return x * 0          # (B, S, H): a stage's hidden states keep their shape
    out = torch.zeros(*x.shape, hidden, dtype=dtype, device=x.device)    # (B, S, H)
    return out.requires_grad_(torch.is_grad_enabled())


def guarded_loss(loss_fn, failures: StageFailures):
    """``loss_fn`` on the last stage: zero (joined to the output, so the backward runs)
    for a stand-in output, where ``loss_fn`` raises, or where what it returns is no loss
    the schedule's backward can start from (recorded: :func:`_not_a_loss`)."""
    def loss(out, target):
        if id(out) in failures.stand_ins:
            return out.sum() * 0
        try:
            value = loss_fn(out, target)
            problem = _not_a_loss(value)
            if problem is not None:
                raise ConfigError(f"pipeline: the loss function {problem}")
            return value
        except Exception as e:      # recorded; raised on every rank after the schedule
            failures.record(e)
            return out.sum() * 0
    return loss


def _not_a_loss(value) -> str | None:
    """Why ``value`` cannot be a microbatch's loss (torch's backward would raise inside
    the schedule, past the point where the other stages can be told), or None."""
    if not isinstance(value, torch.Tensor):
        return (f"returned {type(value).__name__}, not a tensor; return the microbatch's "
                f"loss as a tensor")
    if value.numel() != 1:
        return (f"returned a tensor of shape {tuple(value.shape)}, not one number; reduce "
                f"it to the microbatch's loss (e.g. .mean() or .sum())")
    if not value.is_floating_point():
        return f"returned a {value.dtype} tensor; return a floating-point loss"
    if torch.is_grad_enabled() and not value.requires_grad:
        return ("returned a tensor that does not depend on the model's output (no "
                "gradient); compute the loss from the output it is given")
    return None


class UndoSetupForward:
    """Where torch's schedule sets its stages up (``_runtime._sets_up``), it runs each
    stage's forward once more before the microbatches' own, on the first microbatch's
    inputs or, past the first stage, on uninitialized tensors of the activations' shapes.
    A buffer that forward updates (a running statistic, a data-dependent initialization)
    would keep that extra update, drawn from no data at all past the first stage, where
    one process never runs it. This puts each stage's buffers back as they were before
    that forward: their values, and the tensors themselves where it replaced one."""

    def __init__(self, stages) -> None:
        self._saved: dict[int, list] = {}
        self._done: set[int] = set()
        self._hooks = []
        for st in stages:
            m = st.submod
            self._hooks += [m.register_forward_pre_hook(self._pre),
                            m.register_forward_hook(self._post)]

    def _pre(self, module, args) -> None:
        if id(module) not in self._saved:
            self._saved[id(module)] = [(n, b, b._version, local(b).detach().clone())
                                       for n, b in module.named_buffers()]

    def _post(self, module, args, out) -> None:
        if id(module) in self._done:
            return
        self._done.add(id(module))
        with torch.no_grad():
            for name, tensor, version, value in self._saved.pop(id(module), []):
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                if holder._buffers.get(leaf) is not tensor:
                    holder._buffers[leaf] = tensor       # the forward replaced it
                elif tensor._version == version:
                    continue         # untouched (and perhaps saved for the backward)
                local(tensor).copy_(value)      # this rank's part: no collective

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
