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
    for a stand-in output or where ``loss_fn`` raises (recorded)."""
    def loss(out, target):
        if id(out) in failures.stand_ins:
            return out.sum() * 0
        try:
            return loss_fn(out, target)
        except Exception as e:      # recorded; raised on every rank after the schedule
            failures.record(e)
            return out.sum() * 0
    return loss
