"""precision: parameter, compute and reduction dtypes, and loss scaling."""

from __future__ import annotations

import dataclasses

from .._errors import ConfigError
from .._plan import Plan
from ._base import Transform

_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
            "fp16": "float16", "float16": "float16", None: None}


def _dtype(name, what):
    if name not in _ALIASES:
        raise ConfigError(f"precision({what}={name!r}): use one of 'fp32', 'bf16', 'fp16'")
    return _ALIASES[name]


@dataclasses.dataclass(frozen=True)
class Precision(Transform):
    """Mixed precision. ``compute`` is the dtype of forward/backward math (parameters
    are cast to it, fp32 master weights kept for the optimizer); ``reduce`` is the dtype
    gradients are reduced in; ``loss_scale='dynamic'`` (default for fp16) scales the
    loss and skips steps whose gradients overflow on any rank."""

    compute: str = "float32"
    reduce: str = "float32"
    loss_scale: str | float | None = None
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000

    def apply(self, plan: Plan) -> Plan:
        return plan.with_option("precision", {
            "param": self.compute, "grad": self.reduce, "master": self.compute != "float32",
            "loss_scale": self.loss_scale, "init_scale": self.init_scale,
            "growth_interval": self.growth_interval})

    def __repr__(self) -> str:
        return (f"precision(compute={self.compute!r}, reduce={self.reduce!r}, "
                f"loss_scale={self.loss_scale!r})")


def precision(compute: str = "bf16", reduce: str = "fp32", loss_scale: str | float | None = ...,
              *, init_scale: float = 2.0 ** 16, growth_interval: int = 2000) -> Precision:
    """bf16 / fp16 / fp32 training. fp16 defaults to dynamic loss scaling.

    >>> precision('bf16')
    precision(compute='bfloat16', reduce='float32', loss_scale=None)
    """
    c, r = _dtype(compute, "compute"), _dtype(reduce, "reduce")
    if loss_scale is ...:
        loss_scale = "dynamic" if c == "float16" else None
    if loss_scale not in (None, "dynamic") and not isinstance(loss_scale, (int, float)):
        raise ConfigError(f"precision(loss_scale={loss_scale!r}): None, 'dynamic' or a number")
    return Precision(c, r, loss_scale, float(init_scale), int(growth_interval))
