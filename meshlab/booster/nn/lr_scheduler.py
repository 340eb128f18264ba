"""Colossal-AI's learning-rate schedulers as torch schedulers: each is a ``LambdaLR`` whose
factor at step ``t`` is Colossal-AI's closed form, so a scheduler built on an optimizer
before ``boost`` follows the rebuilt optimizer as any torch scheduler does, and its state
is torch's (``state_dict``, JSON-able).

>>> import torch
>>> from meshlab.booster.nn.lr_scheduler import CosineAnnealingWarmupLR
>>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
>>> s = CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=2)
>>> [round(g["lr"], 3) for g in opt.param_groups]
[0.5]
"""

from __future__ import annotations

import bisect
import math

from torch.optim.lr_scheduler import (ExponentialLR as ExponentialLR, LambdaLR,
                                      MultiplicativeLR as MultiplicativeLR, StepLR as StepLR)

from ...core.errors import ConfigError, check_int


def _check(who: str, total_steps: int, warmup_steps: int = 0) -> None:
    check_int(total_steps, who, "total_steps", low=1, example=1000)
    check_int(warmup_steps, who, "warmup_steps", low=0, example=100)
    if warmup_steps > total_steps:
        raise ConfigError(f"{who}(total_steps={total_steps}, warmup_steps={warmup_steps}): the "
                          f"warm-up is part of the total; make warmup_steps <= total_steps")


class _Factor(LambdaLR):
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


def _cosine(t: int, span: int, base: float, eta_min: float) -> float:
    t = min(t, span)
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / span)) / 2 if span else base


class CosineAnnealingLR(_Factor):
    """Cosine from the lr to ``eta_min`` over ``total_steps``."""

    def __init__(self, optimizer, total_steps: int, eta_min: float = 0.0, last_epoch: int = -1,
                 **kwargs):
        _check("CosineAnnealingLR", total_steps)
        self.total_steps, self.eta_min = total_steps, eta_min
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        return _cosine(t, self.total_steps, base, self.eta_min)


class CosineAnnealingWarmupLR(_Factor):
    """A linear warm-up to the lr over ``warmup_steps`` (step ``t``: ``(t+1)/warmup``),
    then cosine to ``eta_min`` over the remaining steps."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, eta_min: float = 0.0,
                 last_epoch: int = -1):
        _check("CosineAnnealingWarmupLR", total_steps, warmup_steps)
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, warmup_steps, eta_min
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        w = self.warmup_steps
        if t < w:
            return (t + 1) / w * base
        return _cosine(t - w, self.total_steps - w, base, self.eta_min)


class FlatAnnealingLR(_Factor):
    """The lr flat for ``pct_start`` of the steps, then cosine to 0."""

    def __init__(self, optimizer, total_steps: int, pct_start: float = 0.72, last_epoch: int = -1,
                 **kwargs):
        _check("FlatAnnealingLR", total_steps)
        if not 0.0 <= pct_start <= 1.0:
            raise ConfigError(f"FlatAnnealingLR(pct_start={pct_start!r}): a fraction in [0, 1]")
        self.total_steps, self.flat = total_steps, int(total_steps * pct_start)
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        if t < self.flat:
            return base
        return _cosine(t - self.flat, self.total_steps - self.flat, base, 0.0)


class FlatAnnealingWarmupLR(_Factor):
    """A linear warm-up, the lr flat up to ``pct_start`` of the rest, then cosine to
    ``eta_min``."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0,
                 pct_start: float = 0.72, eta_min: int = 0, last_epoch: int = -1, **kwargs):
        _check("FlatAnnealingWarmupLR", total_steps, warmup_steps)
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, warmup_steps, eta_min
        self.flat = int((total_steps - warmup_steps) * pct_start)
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        w, f = self.warmup_steps, self.flat
        if t < w:
            return (t + 1) / w * base
        if t < w + f:
            return base
        return _cosine(t - w - f, self.total_steps - w - f, base, self.eta_min)


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


class MultiStepLR(_Factor):
    """The lr times ``gamma`` at each milestone."""

    def __init__(self, optimizer, total_steps: int, milestones: list | None = None,
                 gamma: float = 0.1, last_epoch: int = -1, **kwargs):
        _check("MultiStepLR", total_steps)
        self.milestones, self.gamma = sorted(milestones or []), gamma
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        return base * self.gamma ** bisect.bisect_right(self.milestones, t)


class MultiStepWarmupLR(_Factor):
    """A linear warm-up, then the lr times ``gamma`` at each milestone."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0,
                 milestones: list | None = None, gamma: float = 0.1, last_epoch: int = -1,
                 **kwargs):
        _check("MultiStepWarmupLR", total_steps, warmup_steps)
        self.warmup_steps, self.gamma = warmup_steps, gamma
        self.milestones = sorted(m - warmup_steps for m in (milestones or []))
        super().__init__(optimizer, last_epoch)

    def _lr(self, t, base):
        w = self.warmup_steps
        if t < w:
            return (t + 1) / w * base
        return base * self.gamma ** bisect.bisect_right(self.milestones, t - w)


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


__all__ = ["CosineAnnealingLR", "CosineAnnealingWarmupLR", "FlatAnnealingLR",
           "FlatAnnealingWarmupLR", "LinearWarmupLR", "MultiStepLR", "MultiStepWarmupLR",
           "PolynomialLR", "PolynomialWarmupLR", "LambdaLR", "MultiplicativeLR", "StepLR",
           "ExponentialLR"]
