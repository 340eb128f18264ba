"""Colossal-AI's learning-rate schedulers as torch schedulers, with Colossal-AI's arguments
(``total_steps`` second, then each schedule's own).

The cosine and multi-step schedules are torch's ``CosineAnnealingLR`` and ``MultiStepLR``,
which work from the optimizer's current rate: built on an optimizer whose rate has already
moved (a second scheduler on a stepped optimizer), they keep that rate and go on from it,
and a warm-up or flat phase put in front of one hands over to it at its step 0. The
linear and polynomial schedules are closed forms of the step and the base rate (the
``initial_lr`` torch keeps in each group). A scheduler built on an optimizer before
``boost`` follows the rebuilt optimizer as any torch scheduler does, and its state is
torch's (``state_dict``, JSON-able; a phased one holds its inner scheduler's state under
``after_scheduler_dict``, as Colossal-AI's does).

>>> import torch
>>> from meshlab.booster.nn.lr_scheduler import CosineAnnealingWarmupLR
>>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
>>> s = CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=2)
>>> [round(g["lr"], 3) for g in opt.param_groups]
[0.5]
"""

from __future__ import annotations

from torch.optim import lr_scheduler as _torch

from ...core.errors import ConfigError, check_int


def _check(who: str, total_steps: int, warmup_steps: int = 0) -> None:
    check_int(total_steps, who, "total_steps", low=1, example=1000)
    check_int(warmup_steps, who, "warmup_steps", low=0, example=100)
    if warmup_steps > total_steps:
        raise ConfigError(f"{who}(total_steps={total_steps}, warmup_steps={warmup_steps}): the "
                          f"warm-up is part of the total; make warmup_steps <= total_steps")


def _pct(who: str, pct_start) -> float:
    if not isinstance(pct_start, (int, float)) or isinstance(pct_start, bool) or \
            not 0.0 <= pct_start <= 1.0:
        raise ConfigError(f"{who}(pct_start={pct_start!r}): a fraction in [0, 1], e.g. 0.72")
    return float(pct_start)


class _Factor(_torch.LambdaLR):
    """A scheduler whose lr is ``factor(t, base_lr) `` at step ``t``."""

    def __init__(self, optimizer, last_epoch: int = -1):
        n = len(optimizer.param_groups)
        bases = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        lambdas = [(lambda t, b=b: self._lr(t, b) / b if b else 0.0) for b in bases][:n]
        super().__init__(optimizer, lambdas, last_epoch)

    def _lr(self, t: int, base: float) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict) -> None:
        # The factors are this class's code: only the counters are state.
        d = dict(state_dict)
        d.pop("lr_lambdas", None)
        self.__dict__.update(d)


class _Phased(_torch.LRScheduler):
    """``warmup_steps`` of linear warm-up to the base rate (step ``t``: ``(t+1)/warmup``),
    ``flat_steps`` at the base rate, then ``after_scheduler`` (a torch scheduler built on
    the same optimizer just before this one) from its step 0: a recursive one (cosine,
    multi-step) starts from the rate the optimizer has then, the base rate after a warm-up
    or flat phase, the optimizer's own rate without one. ``restart`` sets the base rate
    at the hand-over first."""

    _fix = "total_steps larger"

    def __init__(self, optimizer, after_scheduler: _torch.LRScheduler, warmup_steps: int,
                 flat_steps: int = 0, last_epoch: int = -1, restart: bool = False):
        if after_scheduler.optimizer is not optimizer:
            raise ConfigError(f"{type(self).__name__}: the inner scheduler is built on "
                              f"another optimizer; build both on the same one")
        self.after_scheduler = after_scheduler
        self.warmup_steps, self.flat_steps, self.restart = warmup_steps, flat_steps, restart
        super().__init__(optimizer, last_epoch)

    @property
    def _handover(self) -> int:
        return self.warmup_steps + self.flat_steps

    def get_lr(self):
        t, w = self.last_epoch, self.warmup_steps
        if t < w:
            return [(t + 1) / w * b for b in self.base_lrs]
        if t < self._handover:
            return list(self.base_lrs)
        if self.restart and t == self._handover:
            for g, b in zip(self.optimizer.param_groups, self.base_lrs):
                g["lr"] = b
        after = self.after_scheduler
        if self._step_count <= 1:
            # Being built at or past the hand-over: the inner scheduler, built just
            # before, has set its rate already.
            return [g["lr"] for g in self.optimizer.param_groups]
        after.base_lrs = list(self.base_lrs)
        after.last_epoch = -1
        after._initial_step()           # torch's own step 0: from the current rate
        return after.get_last_lr()

    def step(self, epoch: int | None = None) -> None:
        past = self.last_epoch if epoch is None else epoch - 1
        if past < self._handover:
            return super().step(epoch)
        if getattr(self.after_scheduler, "T_max", 1) < 1:
            # torch's cosine over 0 steps divides by 0 on its first step
            raise ConfigError(f"{type(self).__name__}: a step past step {self._handover}, "
                              f"where the warm-up and flat phase end, into a cosine phase "
                              f"of no steps; make {self._fix}")
        self._step_count += 1
        if epoch is None:
            self.last_epoch += 1
            self.after_scheduler.step()
        else:
            self.last_epoch = epoch
            self.after_scheduler.step(epoch - self._handover)
        self._last_lr = self.after_scheduler.get_last_lr()

    def state_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()
             if k not in ("optimizer", "after_scheduler")}
        d["after_scheduler_dict"] = self.after_scheduler.state_dict()
        return d

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or "after_scheduler_dict" not in state_dict:
            raise ConfigError(f"{type(self).__name__}.load_state_dict: the state has no "
                              f"'after_scheduler_dict' (the state of its "
                              f"{type(self.after_scheduler).__name__}); load a state this "
                              f"scheduler's state_dict() returned")
        d = dict(state_dict)
        self.after_scheduler.load_state_dict(d.pop("after_scheduler_dict"))
        d.pop("after_scheduler_type", None)
        self.__dict__.update(d)


class CosineAnnealingLR(_torch.CosineAnnealingLR):
    """torch's ``CosineAnnealingLR`` over ``total_steps``: from the optimizer's rate to
    ``eta_min``."""

    def __init__(self, optimizer, total_steps: int, eta_min: float = 0.0, last_epoch: int = -1,
                 **kwargs):
        _check("CosineAnnealingLR", total_steps)
        super().__init__(optimizer, total_steps, eta_min=eta_min, last_epoch=last_epoch)


class CosineAnnealingWarmupLR(_Phased):
    """A linear warm-up to the lr over ``warmup_steps`` (step ``t``: ``(t+1)/warmup``),
    then torch's ``CosineAnnealingLR`` to ``eta_min`` over the remaining steps."""

    _fix = "warmup_steps < total_steps"

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, eta_min: float = 0.0,
                 last_epoch: int = -1):
        who = "CosineAnnealingWarmupLR"
        _check(who, total_steps, warmup_steps)
        self.total_steps, self.eta_min = total_steps, eta_min
        after = _torch.CosineAnnealingLR(optimizer, total_steps - warmup_steps, eta_min=eta_min,
                                         last_epoch=_inner_epoch(last_epoch, warmup_steps))
        super().__init__(optimizer, after, warmup_steps, last_epoch=last_epoch)


def _inner_epoch(last_epoch: int, handover: int) -> int:
    """The inner scheduler's ``last_epoch`` when the outer one is built at ``last_epoch``."""
    return -1 if last_epoch < handover else last_epoch - handover


class FlatAnnealingLR(_Phased):
    """The lr flat for ``pct_start`` of the steps, then torch's ``CosineAnnealingLR`` to 0."""

    _fix = "pct_start < 1"

    def __init__(self, optimizer, total_steps: int, pct_start: float = 0.72, last_epoch: int = -1,
                 **kwargs):
        who = "FlatAnnealingLR"
        _check(who, total_steps)
        flat = int(total_steps * _pct(who, pct_start))
        self.total_steps = total_steps
        after = _torch.CosineAnnealingLR(optimizer, total_steps - flat,
                                         last_epoch=_inner_epoch(last_epoch, flat))
        super().__init__(optimizer, after, 0, flat, last_epoch=last_epoch)


class FlatAnnealingWarmupLR(_Phased):
    """A linear warm-up, the lr flat for ``pct_start`` of the rest, then (from the base
    rate) torch's ``CosineAnnealingLR`` to ``eta_min``."""

    _fix = "warmup_steps < total_steps and pct_start < 1"

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0,
                 pct_start: float = 0.72, eta_min: int = 0, last_epoch: int = -1, **kwargs):
        who = "FlatAnnealingWarmupLR"
        _check(who, total_steps, warmup_steps)
        flat = int((total_steps - warmup_steps) * _pct(who, pct_start))
        self.total_steps, self.eta_min = total_steps, eta_min
        after = _torch.CosineAnnealingLR(optimizer, total_steps - warmup_steps - flat,
                                         eta_min=eta_min,
                                         last_epoch=_inner_epoch(last_epoch, warmup_steps + flat))
        super().__init__(optimizer, after, warmup_steps, flat, last_epoch=last_epoch,
                         restart=True)


class LinearWarmupLR(_Factor):
    """A linear warm-up over ``warmup_steps`` (``(t+1)/(warmup+1)``), then a linear decay
    to 0 at ``total_steps``."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1,
                 **kwargs):
        _check("LinearWarmupLR", total_steps, warmup_steps)
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        w = self.warmup_steps
        if t < w:
            return (t + 1) / (w + 1) * base
        return (self.total_steps - t) / (self.total_steps - w) * base


def _milestones(who: str, milestones) -> list:
    if milestones is None:
        return []
    try:
        out = [check_int(m, who, "milestones", low=0, example=30) for m in milestones]
    except TypeError:
        raise ConfigError(f"{who}(milestones={milestones!r}): a list of step indices, "
                          f"e.g. milestones=[30, 60]") from None
    return out


class MultiStepLR(_torch.MultiStepLR):
    """torch's ``MultiStepLR``: the lr times ``gamma`` at each milestone."""

    def __init__(self, optimizer, total_steps: int, milestones: list | None = None,
                 gamma: float = 0.1, last_epoch: int = -1, **kwargs):
        _check("MultiStepLR", total_steps)
        super().__init__(optimizer, _milestones("MultiStepLR", milestones), gamma=gamma,
                         last_epoch=last_epoch)


class MultiStepWarmupLR(_Phased):
    """A linear warm-up, then torch's ``MultiStepLR``: the lr times ``gamma`` at each
    milestone (counted from the start; one before the warm-up's end is dropped)."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0,
                 milestones: list | None = None, gamma: float = 0.1, last_epoch: int = -1,
                 **kwargs):
        who = "MultiStepWarmupLR"
        _check(who, total_steps, warmup_steps)
        ms = _milestones(who, milestones)
        if not ms:
            raise ConfigError(f"{who}(milestones={milestones!r}): give at least one step at "
                              f"which the lr decays, e.g. milestones=[30, 60]")
        self.total_steps, self.gamma = total_steps, gamma
        after = _torch.MultiStepLR(optimizer, [m - warmup_steps for m in ms if m >= warmup_steps],
                                   gamma=gamma,
                                   last_epoch=_inner_epoch(last_epoch, warmup_steps))
        super().__init__(optimizer, after, warmup_steps, last_epoch=last_epoch)


class PolynomialLR(_Factor):
    """A polynomial decay of ``power`` to ``end_lr`` at ``total_steps``."""

    def __init__(self, optimizer, total_steps: int, end_lr: float = 0.0001, power: float = 1.0,
                 last_epoch: int = -1, **kwargs):
        _check("PolynomialLR", total_steps)
        self.total_steps, self.end_lr, self.power = total_steps, end_lr, power
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        t = min(t, self.total_steps)
        return (base - self.end_lr) * (1 - t / self.total_steps) ** self.power + self.end_lr


class PolynomialWarmupLR(_Factor):
    """A linear warm-up, then a polynomial decay to ``end_lr``."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, end_lr: float = 0.0001,
                 power: float = 1.0, last_epoch: int = -1, **kwargs):
        _check("PolynomialWarmupLR", total_steps, warmup_steps)
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.end_lr, self.power = end_lr, power
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        w = self.warmup_steps
        if t < w:
            return (t + 1) / w * base
        span = self.total_steps - w
        t = min(t - w, span)
        return (base - self.end_lr) * (1 - t / span) ** self.power + self.end_lr if span else base


def _lambda(who: str, lr_lambda):
    if lr_lambda is None:
        raise ConfigError(f"{who}(optimizer, total_steps, lr_lambda=None): give lr_lambda, a "
                          f"function of the step (or one per parameter group), e.g. "
                          f"lr_lambda=lambda step: 0.95 ** step")
    return lr_lambda


class LambdaLR(_torch.LambdaLR):
    """torch's ``LambdaLR``: the base rate times ``lr_lambda(step)``."""

    def __init__(self, optimizer, total_steps: int, lr_lambda=None, last_epoch: int = -1):
        super().__init__(optimizer, _lambda("LambdaLR", lr_lambda), last_epoch=last_epoch)


class MultiplicativeLR(_torch.MultiplicativeLR):
    """torch's ``MultiplicativeLR``: the rate times ``lr_lambda(step)`` at each step."""

    def __init__(self, optimizer, total_steps: int, lr_lambda=None, last_epoch: int = -1):
        super().__init__(optimizer, _lambda("MultiplicativeLR", lr_lambda),
                         last_epoch=last_epoch)


class StepLR(_torch.StepLR):
    """torch's ``StepLR``: the rate times ``gamma`` every ``step_size`` steps."""

    def __init__(self, optimizer, total_steps: int, step_size: int = 1, gamma: float = 0.1,
                 last_epoch: int = -1):
        super().__init__(optimizer, step_size, gamma=gamma, last_epoch=last_epoch)


class ExponentialLR(_torch.ExponentialLR):
    """torch's ``ExponentialLR``: the rate times ``gamma`` at each step."""

    def __init__(self, optimizer, total_steps: int, gamma: float = 1.0, last_epoch: int = -1):
        super().__init__(optimizer, gamma, last_epoch=last_epoch)


class OneCycleLR(_torch.OneCycleLR):
    """torch's ``OneCycleLR`` over ``total_steps``, peaking at each group's current lr."""

    def __init__(self, optimizer, total_steps: int, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: float = 0.85, max_momentum: float = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 10000.0,
                 last_epoch: int = -1, **kwargs):
        check_int(total_steps, "OneCycleLR", "total_steps", low=1, example=1000)
        super().__init__(optimizer, [g["lr"] for g in optimizer.param_groups],
                         total_steps=total_steps, pct_start=pct_start,
                         anneal_strategy=anneal_strategy, cycle_momentum=cycle_momentum,
                         base_momentum=base_momentum, max_momentum=max_momentum,
                         div_factor=div_factor, final_div_factor=final_div_factor,
                         last_epoch=last_epoch)


__all__ = ["CosineAnnealingLR", "CosineAnnealingWarmupLR", "FlatAnnealingLR",
           "FlatAnnealingWarmupLR", "LinearWarmupLR", "MultiStepLR", "MultiStepWarmupLR",
           "OneCycleLR", "PolynomialLR", "PolynomialWarmupLR", "LambdaLR", "MultiplicativeLR",
           "StepLR", "ExponentialLR"]
