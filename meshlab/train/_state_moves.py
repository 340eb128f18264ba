"""Optimizer state values on their way between ranks and layouts: ``portable`` (a state
dict that pickles across ranks, DTensors as their local blocks), ``placed`` (those blocks
back as DTensors laid out as the parameter) and ``fit_to`` (a saved whole value as the
local block of the tensor the optimizer steps)."""

from __future__ import annotations

import torch

from ..core.tensors import local as _local


class _Block:
    """A DTensor's local block on its way between ranks (a DTensor is not sent whole)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def portable(st):
    """An optimizer state dict that pickles across ranks: tensors detached onto the host,
    DTensors as their local blocks."""
    from torch.distributed.tensor import DTensor

    if st is None:
        return None
    return {k: _Block(v.to_local().detach().cpu().clone()) if isinstance(v, DTensor) else
            v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
            for k, v in st.items()}


def placed(p, st: dict) -> dict:
    """``portable``'s blocks back as DTensors laid out as ``p`` (state shaped like it)."""
    from torch.distributed.tensor import DTensor

    def one(v):
        if not isinstance(v, _Block):
            return v
        if isinstance(p, DTensor) and tuple(v.t.shape) == tuple(_local(p).shape):
            return DTensor.from_local(v.t, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return v.t

    return {k: one(v) for k, v in st.items()}


def fit_to(h, v):
    """A saved state value for the tensor ``h`` the inner optimizer steps: a full plain
    tensor of a DTensor's shape becomes its local block (torch casts the rest)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(h, DTensor) and isinstance(v, torch.Tensor) and \
            not isinstance(v, DTensor) and tuple(v.shape) == tuple(h.shape) and v.dim() > 0:
        return distribute_tensor(v.to(_local(h).device), h.device_mesh, h.placements,
                                 src_data_rank=None)
    return v
