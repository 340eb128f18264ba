"""Colossal-AI's ``colossalai.booster.plugin.hybrid_parallel_plugin`` names a script
imports: the plugin, and ``HybridParallelModule``, the wrapper Colossal-AI's boost puts
around a model (its ``.module`` is the model).

meshlab wraps no model: ``boost`` returns the model object itself, its class mixed with
``ModelWrapper``. So no boosted model is a ``HybridParallelModule``, and a script's
``if isinstance(model, HybridParallelModule): model = model.module...`` keeps the model,
which is what the unwrapping was after.

>>> from torch import nn
>>> from meshlab.booster.plugin.hybrid_parallel_plugin import HybridParallelModule
>>> isinstance(nn.Linear(2, 2), HybridParallelModule)
False
"""

from __future__ import annotations

from ...core.errors import ConfigError
from .._hybrid import HybridParallelPlugin as HybridParallelPlugin


class _NeverAWrapper(type):
    def __instancecheck__(cls, obj) -> bool:
        return False


class HybridParallelModule(metaclass=_NeverAWrapper):
    """Colossal-AI's model wrapper: never an instance in meshlab (``boost`` returns the
    model itself); constructing one is refused."""

    def __new__(cls, *args, **kwargs):
        raise ConfigError("HybridParallelModule(...): meshlab wraps no model; "
                          "booster.boost(model, ...) returns the model itself")
