"""precision: the compute and reduction dtypes, loss scaling, and float8 products.

The room: ``Precision`` (a plan value), its decision (with ``fp8``: which linear layers
compute in float8, ``_float8``), its install (those layers swapped for torchao's, and a
part that gives ``step`` its autocast context and the optimizer its loss scaler). FSDP2
reads the dtypes itself (``zero_shard`` looks them up with ``plan.get(Precision)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from ...core.errors import ConfigError, check_int, check_number
from ...planning.plan import Plan
from .._protocol import Part, Phase, Transform
from ._float8 import RECIPES, Float8Layers, choose, config, convert

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
            "fp16": "float16", "float16": "float16"}


def _dtype(name, what):
    """A dtype name (``'bf16'``, ``'bfloat16'``, ...) as torch spells it; anything else,
    ``None`` included (it would silently mean fp32), lists the names."""
    if not isinstance(name, str) or name not in _ALIASES:
        raise ConfigError(f"precision({what}={name!r}): use one of 'fp32', 'bf16', 'fp16' (or "
                          f"'float32', 'bfloat16', 'float16')")
    return _ALIASES[name]


def _loss_scale(value):
    """``None`` (no scaling), ``'dynamic'``, or a fixed scale: a finite number > 0 (a scale
    of 0 zeroes every gradient, NaN poisons them)."""
    if value is None or (isinstance(value, str) and value == "dynamic"):
        return value
    if isinstance(value, str):
        raise ConfigError(f"precision(loss_scale={value!r}): use None, 'dynamic' or a fixed "
                          f"scale such as 1024.0")
    x = check_number(value, "precision", "loss_scale", example=1024.0)
    return value if type(value) in (int, float) else x     # as written (repr, JSON)


@dataclasses.dataclass(frozen=True)
class Precision(Transform):
    """Mixed precision. ``compute`` is the dtype of forward/backward math (parameters
    are cast to it, fp32 master weights kept for the optimizer); ``reduce`` is the dtype
    gradients are reduced in; ``loss_scale='dynamic'`` (default for fp16) scales the
    loss and skips steps whose gradients overflow on any rank."""

    kind: ClassVar[str] = "precision"
    phase: ClassVar[Phase] = Phase.KERNELS

    compute: str = "float32"
    reduce: str = "float32"
    loss_scale: str | float | None = None
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    float8: str | None = None           # torchao's recipe: the linear layers' products

    def __post_init__(self):
        object.__setattr__(self, "compute", _dtype(self.compute, "compute"))
        object.__setattr__(self, "reduce", _dtype(self.reduce, "reduce"))
        object.__setattr__(self, "loss_scale", _loss_scale(self.loss_scale))
        object.__setattr__(self, "init_scale", check_number(
            self.init_scale, "precision", "init_scale", example=65536.0))
        object.__setattr__(self, "growth_interval", check_int(
            self.growth_interval, "precision", "growth_interval", example=2000))
        object.__setattr__(self, "growth_factor", check_number(
            self.growth_factor, "precision", "growth_factor", example=2.0))
        object.__setattr__(self, "backoff_factor", check_number(
            self.backoff_factor, "precision", "backoff_factor", example=0.5))
        object.__setattr__(self, "hysteresis", check_int(
            self.hysteresis, "precision", "hysteresis", example=2))
        for name in ("min_scale", "max_scale"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, check_number(v, "precision", name,
                                                            example=1.0))
        if self.growth_factor < 1.0 or self.backoff_factor > 1.0:
            raise ConfigError(f"precision(growth_factor={self.growth_factor}, backoff_factor="
                              f"{self.backoff_factor}): the scale grows by a factor >= 1 and "
                              f"backs off by one <= 1, e.g. 2.0 and 0.5")
        if self.float8 is not None:
            if self.float8 not in RECIPES:
                raise ConfigError(f"precision('fp8', recipe={self.float8!r}): torchao's recipes "
                                  f"are {RECIPES}")
            if self.compute != "bfloat16":
                raise ConfigError(f"precision('fp8'): float8 products run beside bf16 "
                                  f"compute (got compute={self.compute!r}); write "
                                  f"precision('fp8') or precision('fp8', recipe='rowwise')")
        if (self.min_scale is not None and self.max_scale is not None
                and self.min_scale > self.max_scale):
            raise ConfigError(f"precision(min_scale={self.min_scale}, max_scale="
                              f"{self.max_scale}): min_scale must not exceed max_scale")

    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """Its compute dtype (``precision('bf16')``), its reduction dtype where that is not
        fp32 (``precision(reduce='bf16')``), and ``precision(loss_scale)`` where it scales
        the loss."""
        compute = "fp8" if self.float8 is not None else _SHORT[self.compute]
        return ((f"precision('{compute}')",)
                + ((f"precision(reduce='{_SHORT[self.reduce]}')",)
                   if self.reduce != "float32" else ())
                + (("precision(loss_scale)",) if self.loss_scale is not None else ()))

    def decide(self, plan: Plan) -> Float8Layers | None:
        """With ``fp8``: the linear layers that compute in float8 (``_float8.choose``)."""
        return choose(plan, self.float8) if self.float8 is not None else None

    def check(self, plan: Plan) -> None:
        if self.float8 is None:
            return
        config(self.float8)                 # torchao installed, or the extra named
        if not plan.decision(Float8Layers).layers:
            raise ConfigError("precision('fp8'): no linear layer of this model has sizes that "
                              "are multiples of 16 (float8 products need them), so nothing "
                              "would compute in float8; use precision('bf16')")

    def install(self, ctx) -> Part:
        if self.float8 is not None:
            chosen = ctx.plan.decision(Float8Layers)
            convert(ctx.model, chosen)
            # every chosen layer this rank runs (a pipeline stage runs its own blocks') is
            # float8 now, or the layout would compute it in bf16 where the plan says float8
            mine = [n for n in chosen.layers
                    if not any(n.startswith(d + ".") for d in ctx.dropped)]
            kinds = {n: type(m).__name__ for n, m in ctx.model.named_modules()}
            missing = [n for n in mine if kinds.get(n) != "Float8Linear"]
            if missing:
                raise ConfigError(f"precision('fp8'): {len(missing)} of the {len(mine)} "
                                  f"linear layers chosen for float8 on this rank were not "
                                  f"swapped for torchao's Float8Linear "
                                  f"({', '.join(missing[:4])}): a room installed before "
                                  f"precision replaced those nn.Linear modules; use "
                                  f"precision('bf16') with this spec")
        cast = None if self.compute == "float32" else getattr(torch, self.compute)
        return PrecisionPart(self, cast, "cuda" if ctx.mesh.device_type == "cuda" else "cpu")

    def profile(self, plan: Plan, model) -> dict | None:
        """The forward under autocast to the compute dtype (fake CPU tensors)."""
        if self.compute == "float32":
            return None
        return {"contexts": [torch.autocast(device_type="cpu",
                                            dtype=getattr(torch, self.compute))]}

    def __repr__(self) -> str:
        extra = "".join(f", {f.name}={getattr(self, f.name)!r}"
                        for f in dataclasses.fields(self)[3:]
                        if getattr(self, f.name) != f.default and f.name != "float8")
        if self.float8 is not None:
            return (f"precision('fp8', recipe={self.float8!r}, reduce={self.reduce!r}"
                    f"{extra})")
        return (f"precision(compute={self.compute!r}, reduce={self.reduce!r}, "
                f"loss_scale={self.loss_scale!r}{extra})")


def precision(compute: str = "bf16", reduce: str = "fp32", loss_scale: str | float | None = ...,
              *, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
              growth_factor: float = 2.0, backoff_factor: float = 0.5, hysteresis: int = 1,
              min_scale: float | None = None, max_scale: float | None = None,
              recipe: str | None = None) -> Precision:
    """bf16 / fp16 / fp32 training. fp16 defaults to dynamic loss scaling. ``'fp8'``: the
    linear layers' products in float8 through torchao (``recipe`` ``'tensorwise'``, the
    default, or ``'rowwise'``), the output head, the layers float8 cannot take and every
    other op in bf16 (``_float8``'s doc).

    The dynamic scale starts at ``init_scale`` (within ``min_scale`` and ``max_scale``); an
    overflowing step is skipped, and after
    ``hysteresis`` overflows the scale is multiplied by ``backoff_factor`` (never below
    ``min_scale``); after ``growth_interval`` clean steps it is multiplied by
    ``growth_factor`` (never above ``max_scale``).

    >>> precision('bf16')
    precision(compute='bfloat16', reduce='float32', loss_scale=None)
    >>> precision('fp16', init_scale=2.0 ** 32, hysteresis=2)
    precision(compute='float16', reduce='float32', loss_scale='dynamic', init_scale=4294967296.0, hysteresis=2)
    >>> precision('fp8')
    precision('fp8', recipe='tensorwise', reduce='float32')
    """
    float8 = None
    if isinstance(compute, str) and compute in ("fp8", "float8"):
        compute, float8 = "bf16", recipe or "tensorwise"
        if loss_scale is ...:
            loss_scale = None
    elif recipe is not None:
        raise ConfigError(f"precision({compute!r}, recipe={recipe!r}): a recipe is float8's; "
                          f"write precision('fp8', recipe={recipe!r})")
    if loss_scale is ...:       # Precision validates and normalizes the rest
        loss_scale = "dynamic" if _dtype(compute, "compute") == "float16" else None
    return Precision(compute, reduce, loss_scale, init_scale, growth_interval, growth_factor,
                     backoff_factor, hysteresis, min_scale, max_scale, float8)


@dataclasses.dataclass
class PrecisionPart(Part):
    """The autocast context of each forward and the loss scaler of the step."""

    value: Precision
    cast: Any
    device: str

    def compute_context(self, parts: tuple):
        """Autocast to the compute dtype, unless a part casts the parameters itself
        (FSDP2's mixed precision)."""
        if self.cast is None or any(p.casts_params for p in parts):
            return None
        return torch.autocast(device_type=self.device, dtype=self.cast)

    def scaler(self):
        from ._scaler import LossScaler

        ls = self.value.loss_scale
        if ls == "dynamic":
            v = self.value
            # the bounds hold from the first step (an init_scale outside them stayed there,
            # halving on overflows, until a growth step first clamped it)
            start = min(v.init_scale, v.max_scale) if v.max_scale is not None else v.init_scale
            start = max(start, v.min_scale) if v.min_scale is not None else start
            return LossScaler(scale=start, growth=v.growth_factor,
                              backoff=v.backoff_factor, growth_interval=v.growth_interval,
                              hysteresis=v.hysteresis, min_scale=v.min_scale,
                              max_scale=v.max_scale)
        if isinstance(ls, (int, float)):
            return LossScaler(scale=float(ls), growth=1.0, backoff=1.0)
        return None
