"""Colossal-AI's ``LazyInitContext`` over the meta device: a model built inside holds no
memory until ``boost`` (``parallelize``) initializes each rank's shards, module by
module, from the seed.

>>> import torch
>>> from meshlab.booster.lazy import LazyInitContext
>>> with LazyInitContext():
...     layer = torch.nn.Linear(4, 4)
>>> layer.weight.is_meta
True
"""

from __future__ import annotations

import torch
from torch import nn

from ...core.errors import ConfigError


def _this_device(device) -> bool:
    """``device`` is this process's device (where ``boost`` and ``materialize`` place the
    model): the CPU without CUDA, the current GPU with it (``'cuda'`` alone included)."""
    from ..utils import get_current_device

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        return False
    here = get_current_device()
    return d.type == here.type and (d.index is None or d.index == (here.index or 0))


class LazyInitContext:
    """``with LazyInitContext(): model = build()`` builds ``model`` on the meta device.
    ``boost`` initializes it (each module's own initializer, seeded alike on every rank),
    so the values are those of a model built from ``parallelize``'s seed, not of the
    global generator at build time. ``LazyInitContext.materialize(model)`` initializes it
    whole, without parallelizing. ``default_device`` may be left out or be this process's
    device (``get_current_device()``): boost places the model there either way; another
    device is refused."""

    def __init__(self, tensor_cls=None, default_device=None) -> None:
        if tensor_cls is not None:
            raise ConfigError("LazyInitContext(tensor_cls=...): meshlab builds on the meta "
                              "device; leave tensor_cls out")
        if default_device not in (None, "meta") and not _this_device(default_device):
            from ..utils import get_current_device

            raise ConfigError(f"LazyInitContext(default_device={default_device!r}): the model "
                              f"is built on the meta device and placed by boost on this "
                              f"process's device ({get_current_device()}); leave it out or "
                              f"pass that device")
        self._device = torch.device("meta")

    def __enter__(self) -> "LazyInitContext":
        self._device.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._device.__exit__(*exc)

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False, seed: int = 0) -> nn.Module:
        """Initialize a model built inside the context on this process's device."""
        from ...apply.materialize import init_weights
        from ..utils import get_current_device

        init_weights(module, seed, device=str(get_current_device()))
        return module
