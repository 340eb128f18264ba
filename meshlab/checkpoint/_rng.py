"""Each rank's random-number states (torch, CUDA, Python, NumPy) as JSON.

A bitwise resume needs them (dropout draws from them). ``parse`` turns a stored state
into the objects the generators take, refusing anything malformed, so that ``load``
checks the file before it writes any weight and ``restore`` cannot fail halfway.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from ._safe import CheckpointError


def _to_json(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (tuple, list)):
        return [_to_json(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def capture() -> dict:
    st = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
          "python": _to_json(random.getstate()),
          "numpy": _to_json(np.random.get_state())}
    if torch.cuda.is_available():
        st["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                      for s in torch.cuda.get_rng_state_all()]
    return st


def _bytes(s: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def parse(st: Any, where: str) -> dict:
    """The generator states in ``st`` ready for ``restore``; a ``CheckpointError`` naming
    ``where`` if any is malformed."""
    try:
        out = {"torch": _bytes(st["torch"])}
        v = st["python"]
        out["python"] = (int(v[0]), tuple(int(x) for x in v[1]), v[2])
        n = st["numpy"]
        out["numpy"] = (str(n[0]), np.array(n[1], dtype=np.uint32), int(n[2]), int(n[3]),
                        float(n[4]))
        if "cuda" in st:
            out["cuda"] = [_bytes(s) for s in st["cuda"]]
        probe = random.Random()
        probe.setstate(out["python"])
        np.random.RandomState().set_state(out["numpy"])
        torch.Generator().set_state(out["torch"])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{where} is damaged: its random-number states do not parse "
                              f"({type(e).__name__}: {e}); load with restore_rng=False to "
                              f"skip them, or load an older checkpoint") from None
    return out


def restore(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
