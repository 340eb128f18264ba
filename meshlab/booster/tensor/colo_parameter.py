"""``ColoParameter``: Colossal-AI's type of a parameter its plugins manage.

meshlab's plugins make no parameter class of their own: a sharded parameter is an
``nn.Parameter`` holding a ``DTensor`` (what ``parallelize`` and FSDP2 leave in the
model). ``isinstance(p, ColoParameter)`` asks exactly that, so a check written for
Colossal-AI's Gemini (every parameter of the boosted model is one) holds for meshlab's
``GeminiPlugin`` and fails for a parameter nothing sharded.

>>> import torch
>>> from meshlab.booster.tensor import ColoParameter
>>> isinstance(torch.nn.Parameter(torch.zeros(2)), ColoParameter)
False
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ...core.errors import ConfigError


class _IsShardedParameter(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.nn.Parameter) and isinstance(obj, DTensor)


class ColoParameter(metaclass=_IsShardedParameter):
    """A parameter a plugin sharded: an ``nn.Parameter`` holding a ``DTensor``. Only
    ``isinstance`` is meaningful; ``boost`` makes them (constructing one is refused)."""

    def __new__(cls, *args, **kwargs):
        raise ConfigError("ColoParameter(...): meshlab makes sharded parameters in "
                          "booster.boost (meshlab.parallelize); use a torch nn.Parameter and "
                          "boost the model")
