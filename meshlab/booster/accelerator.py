"""Colossal-AI's accelerator API: ``get_accelerator()`` (this process's device: CUDA
where torch sees a GPU, else the CPU) and the Booster's ``Accelerator(device)``.

>>> from meshlab.booster.accelerator import get_accelerator
>>> get_accelerator().get_current_device().type in ("cpu", "cuda")
True
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.errors import ConfigError


class _Cuda:
    """The current CUDA device: each call is torch.cuda's of the same name."""

    name = "cuda"
    communication_backend = "nccl"

    def get_current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def __getattr__(self, name: str):
        # set_device, device_count, empty_cache, synchronize, memory stats, manual_seed,
        # Stream, ... are torch.cuda's own.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(torch.cuda, name)

    def reset_max_memory_cached(self) -> None:
        torch.cuda.reset_peak_memory_stats()


class _Cpu:
    """The host: there is no device cache, stream or allocator statistic to act on, so
    those calls return at once (as Colossal-AI's CPU accelerator's do)."""

    name = "cpu"
    communication_backend = "gloo"

    def get_current_device(self) -> torch.device:
        return torch.device("cpu")

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def set_device(self, device=None) -> None:
        if device not in (None, "cpu", 0) and torch.device(device).type != "cpu":
            raise ConfigError(f"get_accelerator().set_device({device!r}): this process runs "
                              f"on the CPU")

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    # Cache, synchronization and statistics: nothing to do on the host.
    def empty_cache(self) -> None: ...
    def synchronize(self, device=None) -> None: ...
    def reset_peak_memory_stats(self, device=None) -> None: ...
    def reset_max_memory_allocated(self, device=None) -> None: ...
    def reset_max_memory_cached(self, device=None) -> None: ...

    def max_memory_allocated(self, device=None) -> int:
        return 0

    def memory_allocated(self, device=None) -> int:
        return 0


def get_accelerator():
    """This process's accelerator: CUDA's (the current GPU) where torch sees one, else
    the CPU's."""
    return _Cuda() if torch.cuda.is_available() else _Cpu()


class Accelerator:
    """``Accelerator(device)``: moves a model onto ``'cuda'`` (the current GPU) or
    ``'cpu'``; a device this machine lacks is refused by name."""

    def __init__(self, device: str) -> None:
        kind = str(device).split(":")[0]
        if kind not in ("cuda", "cpu"):
            raise ConfigError(f"Accelerator({device!r}): 'cuda' or 'cpu'")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"Accelerator({device!r}): this machine has no CUDA device; "
                              f"use Accelerator('cpu')")
        self.device = torch.device(device) if kind == "cpu" or ":" in str(device) else \
            torch.device("cuda", torch.cuda.current_device())

    def bind(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def configure_model(self, model: nn.Module) -> nn.Module:
        """``model`` on this accelerator's device."""
        return model.to(self.device)
