"""Dtype names and sizes as plans write them (``'bfloat16'``, 2 bytes)."""

from __future__ import annotations

import torch

from ._errors import PlanError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8,
               "int32": 4, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1}


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


def dtype_bytes(name: str) -> int:
    if name not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]
