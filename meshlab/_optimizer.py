"""``optimizer``: a torch optimizer driven the way a parallelized model needs.

``opt.step()`` does everything a step needs after ``backward``, in order: each room's
gradient synchronization (``Part.sync_grads``: tensor- and sequence-parallel sums, then
the data-parallel all-reduce or the ZeRO-1 reduce-scatter), unscaling and the overflow
check agreed by every rank, global gradient-norm clipping across all mesh axes, the
update, and each room's ``after_step`` (ZeRO-1's all-gather). A plain ``loss.backward();
opt.step()`` loop is therefore correct; ``step`` adds microbatching, mixed precision and
loss scaling around it.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ._errors import ConfigError
from ._tensors import local as _local
from .parallel._install import runtime_of
from .parallel.precision import PrecisionPart
from .parallel.zero._install import Zero1Part
from .parallel.zero._zero1 import shard_groups


def _params_of(cls) -> set[str]:
    try:
        return set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return set()


class MeshOptimizer:
    """A torch optimizer driven the way a parallelized model needs (see module doc)."""

    def __init__(self, model: nn.Module, cls: type, *, clip_grad_norm: float | None = None,
                 **kwargs: Any) -> None:
        self.model, self.rt = model, runtime_of(model)
        self.clip = clip_grad_norm
        seen: set[int] = set()
        self.params: list[tuple[str, nn.Parameter]] = []
        for n, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append((n, p))
        prec = self.rt.part(PrecisionPart)
        self.scaler = prec.scaler() if prec is not None else None
        inner = None
        for part in self.rt.parts:
            inner = part.optimizer_params(self.params) or inner
        if inner is None:
            from torch.distributed.tensor import DTensor

            inner = [p for _, p in self.params]
            kinds = {isinstance(p, DTensor) for p in inner}
            if len(kinds) > 1 and "foreach" in _params_of(cls) and "foreach" not in kwargs:
                # torch's multi-tensor kernels group by device and dtype, not by tensor
                # type: DTensor and plain parameters in one list fail on CUDA.
                kwargs["foreach"] = False
        self.inner = cls(inner, **kwargs)
        self.last_grad_norm: float | None = None
        self._synced = False

    # -- ZeRO-1's buffers, for checkpoints and tests -------------------------------------
    @property
    def zero1(self):
        """This optimizer's ZeRO-1 buffers (``Zero1Buffers``), or None."""
        part = self.rt.part(Zero1Part)
        return part.buffers if part is not None else None

    @property
    def buckets(self) -> list:
        return self.zero1.buckets if self.zero1 is not None else []

    @property
    def shards(self) -> list:
        return self.zero1.shards if self.zero1 is not None else []

    def refresh_master(self) -> None:
        """Copy the parameters into this rank's fp32 master slices (after a load)."""
        if self.zero1 is not None:
            self.zero1.refresh_master()

    # -- the step -------------------------------------------------------------------
    def _sync_grads(self) -> None:
        """Every room's gradient sync (once per step: calling it again is a no-op)."""
        if self._synced:
            return
        self._synced = True
        for part in self.rt.sync_parts:
            part.sync_grads(self.params)

    def _grad_items(self) -> list[tuple[torch.Tensor, tuple]]:
        """(local gradient, groups it is sharded over) for the norm and overflow checks."""
        items = [(_local(p.grad), shard_groups(p.grad)) for _, p in self.params
                 if p.grad is not None]
        for part in self.rt.parts:
            items = part.grad_items(items)
        return items

    def grad_norm(self) -> float:
        """The global L2 norm of all gradients, over every mesh axis."""
        sums: dict[tuple, list] = {}
        for g, groups in self._grad_items():
            key = tuple(id(x) for x in groups)
            acc = sums.setdefault(key, [torch.zeros((), dtype=torch.float64, device=g.device),
                                        groups])
            acc[0] += g.detach().double().pow(2).sum()
        total = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        for s, groups in sums.values():
            for grp in groups:
                dist.all_reduce(s, group=grp)
            total += s.to(total.device)
        for part in self.rt.parts:          # e.g. each pipeline stage holds other parameters
            for grp in part.norm_groups():
                dist.all_reduce(total, group=grp)
        return float(total.sqrt())

    def step(self) -> bool:
        """Synchronize, unscale, check overflow, clip, update. Returns False if skipped."""
        self._sync_grads()
        items = self._grad_items()
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            for g, _ in items:
                g.mul_(inv)
            overflow = self.scaler.found_inf([g for g, _ in items], self.rt.device)
            self.scaler.update(overflow)
            if overflow:
                self.zero_grad()
                return False
        if self.clip is not None:
            norm = self.grad_norm()
            self.last_grad_norm = norm
            coef = self.clip / (norm + 1e-6)
            if coef < 1.0:
                for g, _ in items:
                    g.mul_(coef)
        self.inner.step()
        for part in self.rt.parts:
            part.after_step()
        self._synced = False
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._synced = False
        for _, p in self.params:
            p.grad = None
        for s in self.shards:
            s.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def state_dict(self) -> dict:
        d = {"inner": self.inner.state_dict()}
        if self.scaler is not None:
            d["scaler"] = self.scaler.state_dict()
        return d

    def load_state_dict(self, d: Mapping) -> None:
        self.inner.load_state_dict(d["inner"])
        if self.scaler is not None and "scaler" in d:
            self.scaler.load_state_dict(d["scaler"])


def optimizer(model: nn.Module, cls: type = torch.optim.AdamW, *,
              clip_grad_norm: float | None = None, **kwargs: Any) -> MeshOptimizer:
    """An optimizer over a parallelized model's parameters (``cls(**kwargs)`` inside).

    ``clip_grad_norm`` clips by the global norm over all mesh axes. ZeRO-1 keeps the
    optimizer state for this rank's slice only.

    >>> opt = optimizer(model, torch.optim.AdamW, lr=3e-4, clip_grad_norm=1.0)  # doctest: +SKIP
    """
    if not isinstance(cls, type):
        raise ConfigError(f"optimizer(model, cls, ...): cls must be an optimizer class such as "
                          f"torch.optim.AdamW, got {cls!r}")
    return MeshOptimizer(model, cls, clip_grad_norm=clip_grad_norm, **kwargs)
