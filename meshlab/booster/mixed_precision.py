"""Colossal-AI's mixed-precision objects, each a ``meshlab.precision(...)`` value
(``.precision``): ``Booster(mixed_precision=FP16TorchMixedPrecision())`` is
``Booster(mixed_precision='fp16')``.

>>> from meshlab.booster.mixed_precision import FP16TorchMixedPrecision
>>> FP16TorchMixedPrecision(init_scale=1024).precision.loss_scale
'dynamic'
"""

from __future__ import annotations

from ._amp import PrecisionValue
from ._args import UnsupportedArgument


class MixedPrecision(PrecisionValue):
    """A precision the Booster applies (``precision``: the meshlab transform)."""

    def configure(self, model, optimizer=None, criterion=None):
        """``(model, optimizer, criterion)`` trained in this precision: one
        ``Booster(plugin=TorchDDPPlugin(), mixed_precision=self).boost(...)`` (data
        parallel over the launched ranks; one process trains alone)."""
        from ._booster import Booster
        from .plugin import TorchDDPPlugin

        out = Booster(plugin=TorchDDPPlugin(), mixed_precision=self).boost(
            model, optimizer, criterion)
        return out[0], out[1], out[2]


class FP16TorchMixedPrecision(MixedPrecision):
    """fp16 autocast with torch's dynamic loss scale: ``precision('fp16', ...)``."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        from ..transforms import precision

        self.precision = precision("fp16", "fp32", "dynamic", init_scale=float(init_scale),
                                   growth_factor=float(growth_factor),
                                   backoff_factor=float(backoff_factor),
                                   growth_interval=growth_interval)


class BF16MixedPrecision(MixedPrecision):
    """bf16 autocast: ``precision('bf16')``."""

    def __init__(self) -> None:
        from ..transforms import precision

        self.precision = precision("bf16")


def _refused(name: str, why: str):
    class Refused(MixedPrecision):
        def __init__(self, *args, **kwargs) -> None:
            raise UnsupportedArgument("Booster", "mixed_precision", name, why,
                                      "FP16TorchMixedPrecision() or BF16MixedPrecision()")

    Refused.__name__ = Refused.__qualname__ = name
    Refused.__doc__ = f"Refused: {why}."
    return Refused


FP16ApexMixedPrecision = _refused("FP16ApexMixedPrecision", "apex amp is not implemented")
FP16NaiveMixedPrecision = _refused("FP16NaiveMixedPrecision", "naive fp16 (fp16 parameters "
                                   "without fp32 masters) is not implemented")
FP8MixedPrecision = _refused("FP8MixedPrecision", "FP8 compute is not implemented")

_BY_NAME = {"fp16": FP16TorchMixedPrecision, "bf16": BF16MixedPrecision,
            "fp16_apex": FP16ApexMixedPrecision, "fp16_naive": FP16NaiveMixedPrecision,
            "fp8": FP8MixedPrecision}


def mixed_precision_factory(mixed_precision_type: str) -> MixedPrecision:
    """The object of a ``Booster(mixed_precision=...)`` string."""
    from ..core.errors import ConfigError

    if mixed_precision_type not in _BY_NAME:
        raise ConfigError(f"mixed_precision_factory({mixed_precision_type!r}): one of "
                          f"{', '.join(_BY_NAME)}")
    return _BY_NAME[mixed_precision_type]()
