"""Colossal-AI's ``colossalai.utils`` helpers a training script uses."""

from __future__ import annotations

import random

import torch


def get_current_device() -> torch.device:
    """This process's device (``get_accelerator().get_current_device()``)."""
    from ..accelerator import get_accelerator

    return get_accelerator().get_current_device()


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's)."""
    from ...core.errors import check_int

    check_int(seed, "set_seed", "seed", low=0, example=42)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
