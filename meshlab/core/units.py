"""Units: dtype names and sizes as plans write them (``'bfloat16'``, 2 bytes; the 4-bit
types of a quantized base, ``'nf4'`` and ``'fp4'``, half a byte: two values a byte), and
bytes as people read them (``fmt_bytes``)."""

from __future__ import annotations

import torch

from .errors import PlanError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8,
               "int32": 4, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "nf4": 0.5, "fp4": 0.5}

# The 4-bit types bitsandbytes packs two to a byte (``lora(quantize=...)``'s base weights):
# no torch dtype names them, and no room may split or cast them.
PACKED_4BIT = ("nf4", "fp4")


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


def dtype_bytes(name: str) -> float:
    """Bytes per element: an integer for torch's dtypes, 0.5 for the packed 4-bit ones."""
    if name not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, as every table of meshlab prints them.

    >>> fmt_bytes(3 * 2**30)
    '3.00 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
