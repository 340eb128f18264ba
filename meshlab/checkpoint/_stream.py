"""A safetensors file written one tensor at a time.

``safetensors.torch.save_file`` takes every tensor of a file at once, so a writer holding
a 5 GB shard holds 5 GB. The format needs only the names, dtypes and shapes up front (the
header: an 8-byte little-endian length, then JSON with each tensor's byte range), and the
data follow in the header's order; every shape is known before an export gathers its
first tensor, so the header is written first and each tensor's bytes as soon as it arrives.
Rank 0 then holds one tensor at a time whatever the shard size
(``tests/checkpoint/test_export_memory_gloo.py`` measures it). The file reads back with
``safetensors.safe_open`` / ``load_file`` and transformers' ``from_pretrained``.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
           torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class StreamWriter:
    """``entries``: ``[(name, shape, dtype)]`` in the order ``write`` is called."""

    def __init__(self, path: str, entries: list, metadata: dict | None = None):
        header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
        self.order, offset = [], 0
        for name, shape, dtype in entries:
            if dtype not in _DTYPES:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors name")
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            self.order.append((name, tuple(shape), dtype, n))
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)            # the data start 8-byte aligned
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        want, shape, dtype, n = self.order[self.next]
        if name != want or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype}: the header expects {want} "
                             f"{shape} {dtype} here")
        if t.numel():     # the tensor's own bytes, no copy of them
            self.f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                         .numpy())
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            self.f.close()
            raise ValueError(f"{len(self.order) - self.next} tensors of the header were not "
                             f"written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
