"""``Lamb``: Colossal-AI's LAMB (``colossalai.nn.optimizer.Lamb``) on ``torch_optimizer.Lamb``.

Imported on first use of ``meshlab.booster.nn.optimizer.Lamb``; needs the ``optim`` extra
(``pip install 'meshlab[optim]'``, which installs ``torch-optimizer``).
"""

from __future__ import annotations

import math

import torch

from ..core.log import require

_lib = require("torch_optimizer", "optim", "Lamb (Colossal-AI's LAMB optimizer)")

# What the library keeps in each parameter's state besides Colossal-AI's keys.
_LIBRARY_ONLY_STATE = ("weight_norm", "adam_norm", "trust_ratio")


def _library_step():
    """The library's ``step`` itself: torch wraps a class's ``step`` with the step hooks
    once an instance of it exists, and this class's own ``step`` already runs them."""
    step = _lib.Lamb.step
    return getattr(step, "__wrapped__", step)


class Lamb(_lib.Lamb):
    """Colossal-AI's ``Lamb`` (same arguments and defaults): Adam's moments, an update
    ``m / (sqrt(v) + eps) + weight_decay * w`` scaled by the trust ratio
    ``||w|| / ||update||`` (1 where either norm is 0, or always with ``adam=True``), and
    with ``bias_correction`` the learning rate times ``sqrt(1 - beta2^t) / (1 - beta1^t)``.

    The update is ``torch_optimizer.Lamb``'s; where that library differs from Colossal-AI,
    this class follows Colossal-AI:

    * the library clamps ``||w||`` to ``clamp_value`` (10 by default); Colossal-AI does not
      clamp, so neither does this (``clamp_value=inf``);
    * ``bias_correction`` is a per-group option, as in Colossal-AI (the library's
      ``debias`` holds for every group);
    * ``lr=0`` is accepted (the library refuses it; a warmup scheduler may have set the
      rate to 0 before ``boost`` rebuilds the optimizer with the current rate);
    * each parameter's state holds Colossal-AI's keys (``step``, ``exp_avg``,
      ``exp_avg_sq``); the library's last ``weight_norm``, ``adam_norm`` and
      ``trust_ratio`` are dropped after each step (on DTensor parameters ``adam_norm``
      would be a pending reduction kept in the state);
    * ``step`` stays an int, as Colossal-AI and the library keep it (meshlab's checkpoints
      keep numbers in an optimizer's state beside its tensors).

    A negative ``weight_decay`` is refused (by the library); Colossal-AI accepts it.

    The trust ratio is a norm over the whole tensor. On DTensor parameters (tensor
    parallelism by specs, ``zero_shard(3)``) ``torch.norm`` is the norm of the full tensor,
    reduced over the mesh, so the update equals one process's. ZeRO-1 steps flat slices of
    the parameters only for elementwise optimizers; LAMB (not registered as elementwise)
    gets whole tensors there, each parameter stepped by the data rank that owns it.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0,
                 adam=False, bias_correction=False):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        # The library refuses lr=0: give it each group's rate in the group instead.
        groups = params
        if not isinstance(params, torch.Tensor):        # (torch refuses a lone tensor)
            groups = list(params)
            if groups and not isinstance(groups[0], dict):
                groups = [{"params": groups}]
            groups = [{**g, "lr": g.get("lr", lr)} for g in groups]
        super().__init__(groups, lr=lr or 1.0, betas=betas, eps=eps, weight_decay=weight_decay,
                         clamp_value=math.inf, adam=adam, debias=bias_correction)
        self.defaults["lr"] = lr
        self.defaults["bias_correction"] = bias_correction
        for g in self.param_groups:
            g.setdefault("bias_correction", bias_correction)
        # What ``boost`` rebuilds it with (``adam`` is not a group option).
        self.meshlab_class = Lamb
        self.meshlab_kwargs = dict(lr=lr, betas=tuple(betas), eps=eps,
                                   weight_decay=weight_decay, adam=adam,
                                   bias_correction=bias_correction)

    @torch.no_grad()
    def _step_group(self, group: dict) -> None:
        groups = self.param_groups
        self.debias = bool(group["bias_correction"])
        self.param_groups = [group]
        try:
            _library_step()(self)
        finally:
            self.param_groups = groups
            for s in map(self.state.get, group["params"]):
                for k in _LIBRARY_ONLY_STATE if s else ():
                    s.pop(k, None)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss
