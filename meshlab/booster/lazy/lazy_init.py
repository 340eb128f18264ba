"""Colossal-AI's ``LazyInitContext`` over the meta device: a model built inside holds no
memory until ``boost`` (``parallelize``) initializes each rank's shards, module by
module, from the seed. A Hugging Face model loaded inside with ``from_pretrained(dir)`` is
built on the meta device from the directory's config, and ``boost`` loads the directory's
weights into each rank's shards (``checkpoint.load_pretrained``, one tensor at a time), as
Colossal-AI's lazy tensors replay the load.

>>> import torch
>>> from meshlab.booster.lazy import LazyInitContext
>>> with LazyInitContext():
...     layer = torch.nn.Linear(4, 4)
>>> layer.weight.is_meta
True
"""

from __future__ import annotations

import os
import weakref

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


# models built lazily by from_pretrained -> the directory boost loads their weights from
_PRETRAINED: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
_DTYPES = ("dtype", "torch_dtype")


def pretrained_source(model: nn.Module) -> str | None:
    """The directory ``from_pretrained`` named for ``model`` inside a ``LazyInitContext``,
    whose weights ``boost`` loads; None for any other model."""
    return _PRETRAINED.get(model)


def _lazy_from_pretrained(cls, path, *args, **kwargs):
    """``from_pretrained`` inside the context: the model from the directory's config on
    the meta device, in the dtype ``from_pretrained`` would give it; the weights are
    ``boost``'s to load."""
    other = sorted(set(kwargs) - set(_DTYPES) - {"config"})
    if args or other or not os.path.isdir(os.fspath(path)):
        raise ConfigError(
            f"{cls.__name__}.from_pretrained({path!r}, ...) inside LazyInitContext: meshlab "
            f"builds the model from a local directory's config and boost loads its weights; "
            f"it takes dtype= and config= only (got {other or list(args)}). Load the model "
            f"outside the context, or boost a lazily built one and call "
            f"booster.load_model(model, directory)")
    config = kwargs.get("config") or cls.config_class.from_pretrained(path)
    dtype = next((kwargs[k] for k in _DTYPES if kwargs.get(k) is not None), "auto")
    if dtype == "auto":          # from_pretrained's default: the checkpoint's own dtype
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) \
            or torch.get_default_dtype()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = cls._from_config(config).to(dtype)
    _PRETRAINED[model] = os.fspath(path)
    return model


class LazyInitContext:
    """``with LazyInitContext(): model = build()`` builds ``model`` on the meta device.
    ``boost`` initializes it (each module's own initializer, seeded alike on every rank),
    so the values are those of a model built from ``parallelize``'s seed, not of the
    global generator at build time. An initialization the constructor does by hand, past
    its modules' own (``nn.init.zeros_(self.out.weight)`` in ``__init__``), is not
    replayed: the meta device records none; put it in the module's ``reset_parameters``. ``LazyInitContext.materialize(model)`` initializes it
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
        from transformers import PreTrainedModel

        self._device.__enter__()
        self._saved = PreTrainedModel.__dict__["from_pretrained"]
        PreTrainedModel.from_pretrained = classmethod(_lazy_from_pretrained)
        return self

    def __exit__(self, *exc) -> None:
        from transformers import PreTrainedModel

        PreTrainedModel.from_pretrained = self._saved
        self._device.__exit__(*exc)

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False, seed: int = 0) -> nn.Module:
        """Initialize a model built inside the context on this process's device."""
        from ...apply.materialize import init_weights
        from ..utils import get_current_device

        init_weights(module, seed, device=str(get_current_device()))
        return module
