"""``HybridAdamW``: one AdamW over tensors on the host and on the device.

It is one ``torch.optim.Optimizer`` (its ``param_groups`` torch's, one ``state`` in
``torch.optim.AdamW``'s layout, so ``state_dict()`` does not depend on where a tensor
lives and loads across offload fractions). Host tensors are stepped by ``CPUAdamW``'s C++
loop through the offload part's pipeline (gradient copied in, update, parameter copied
out, tensor by tensor); device tensors by the optimizer class the user named (e.g.
``torch.optim.AdamW(fused=True)``), sharing the same ``state``.
"""

from __future__ import annotations

import torch

from ...core.errors import ConfigError
from ...ops.cpu_adam import CPUAdamW
from .._gradsync import mark_mesh_optimizer

_HYPER = ("lr", "betas", "eps", "weight_decay")
_DEVICE_ONLY = ("foreach", "fused", "capturable", "differentiable")


_NEUTRAL = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False,
            "foreach": None, "fused": None}


def adamw_family(cls: type, kwargs: dict) -> dict:
    """``kwargs`` split for the device optimizer, refused unless ``cls`` computes what the
    CPU AdamW does (decoupled weight decay, no AMSGrad)."""
    from ...ops.fused_adamw import FusedAdamW

    wd = kwargs.get("weight_decay", 1e-2 if cls is not torch.optim.Adam else 0.0)
    ok = cls in (torch.optim.AdamW, FusedAdamW, CPUAdamW) or (
        cls is torch.optim.Adam and wd == 0)
    if not ok:
        raise ConfigError(
            f"offload(optimizer>0) updates host-resident state with meshlab.ops.CPUAdamW, so "
            f"the device part must compute the same AdamW; got {cls.__name__}"
            f"{' with weight_decay != 0 (coupled decay)' if cls is torch.optim.Adam else ''}. "
            f"Use meshlab.optimizer(model, torch.optim.AdamW, ...), or offload(optimizer=0)")
    # torch's own defaults (amsgrad=False, maximize=False, ...) are what the CPU AdamW
    # computes: a plain AdamW(model.parameters(), lr=...) passes them all.
    bad = sorted(k for k in set(kwargs) - set(_HYPER) - set(_DEVICE_ONLY)
                 if not (k in _NEUTRAL and kwargs[k] == _NEUTRAL[k]))
    if bad or kwargs.get("amsgrad") or kwargs.get("maximize"):
        raise ConfigError(f"offload(optimizer>0): {cls.__name__}({', '.join(bad)}=...) is not "
                          f"computed by the CPU AdamW; pass only {', '.join(_HYPER)}")
    return {k: v for k, v in kwargs.items() if k in _DEVICE_ONLY}


class HybridAdamW(torch.optim.Optimizer):
    """AdamW over ``params`` (tensors, or torch's list of group dicts, each group with its
    own ``lr``, ``betas``, ``eps`` and ``weight_decay``) where the tensors whose ids are in
    ``host`` are updated by ``pipeline.host_step`` (the offload part) and the rest by
    ``device_cls``, one device group per group that holds device tensors."""

    def __init__(self, params, *, host: set[int], pipeline, device_cls: type,
                 device_kwargs: dict, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        for i, group in enumerate(self.param_groups):
            extra = sorted(k for k in group if k not in ("params",) + _HYPER + _DEVICE_ONLY
                           and not (k in _NEUTRAL and group[k] == _NEUTRAL[k]))
            if extra:
                raise ConfigError(f"offload(optimizer>0): parameter group {i} sets "
                                  f"{', '.join(extra)}, which the CPU AdamW does not compute; "
                                  f"a group may set only {', '.join(_HYPER)}")
        self.host_ids, self.pipeline = set(host), pipeline
        # (index of the group, its device tensors) for the groups that hold any
        self._device = [(i, [p for p in g["params"] if id(p) not in self.host_ids])
                        for i, g in enumerate(self.param_groups)]
        self._device = [(i, dev) for i, dev in self._device if dev]
        self.device_opt = None
        if self._device:
            if device_cls is CPUAdamW:
                device_cls = torch.optim.AdamW
            self.device_opt = device_cls(
                [{"params": dev, **{k: self.param_groups[i][k] for k in _HYPER}}
                 for i, dev in self._device],
                lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **device_kwargs)
            self.device_opt.state = self.state          # one state, one state_dict
            mark_mesh_optimizer(self.device_opt)

    @property
    def host_params(self) -> list:
        return [p for g in self.param_groups for p in g["params"] if id(p) in self.host_ids]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("HybridAdamW.step takes no closure")
        if self.device_opt is not None:
            # a scheduler or the user sets a group's options here: the device groups follow
            for dg, (i, _) in zip(self.device_opt.param_groups, self._device):
                for k, v in self.param_groups[i].items():
                    if k != "params":
                        dg[k] = v
            self.device_opt.step()
        self.pipeline.host_step(self, [(g, [p for p in g["params"] if id(p) in self.host_ids])
                                       for g in self.param_groups])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.pipeline.zero_grad()
