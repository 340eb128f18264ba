"""Dynamic loss scaling whose overflow decision every rank takes together."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class LossScaler:
    """Scale the loss; on inf/NaN gradients on *any* rank, every rank skips the step, and
    at the ``hysteresis``-th overflow since the scale last changed it is multiplied by
    ``backoff`` (not below ``min_scale``); after ``growth_interval`` clean steps it is
    multiplied by ``growth`` (not above ``max_scale``). ``found_inf`` is all-reduced with MAX over the world, so
    no rank can step while another skips (the Megatron rule)."""

    scale: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    clean_steps: int = 0
    skipped: int = 0
    overflows: int = 0          # since the scale last changed (counted against hysteresis)

    def found_inf(self, grads: list[torch.Tensor], device=None) -> bool:
        """Whether any rank's ``grads`` hold an inf or NaN (one fused check per device
        and dtype, one all-reduce, one read of the flag)."""
        return self.unscale_(grads, device, inv_scale=1.0)

    def unscale_(self, grads: list[torch.Tensor], device=None, *,
                 inv_scale: float | None = None) -> bool:
        """Multiply ``grads`` by ``inv_scale`` (default ``1 / scale``) in place and say
        whether any rank's held an inf or NaN: torch's fused multi-tensor kernel
        (``_amp_foreach_non_finite_check_and_unscale_``, GradScaler's) per device and
        dtype, the flags summed on ``device``, one all-reduce with MAX over the world, and
        one read of the result: no host sync per gradient."""
        import torch.distributed as dist

        inv = 1.0 / self.scale if inv_scale is None else inv_scale
        flag = torch.zeros(1, device=device)
        groups: dict = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), gs in groups.items():
            found = torch.zeros(1, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(
                gs, found, torch.full((1,), inv, device=dev))
            flag += found.to(flag.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.clean_steps = 0
            self.skipped += 1
            self.overflows += 1
            if self.overflows >= self.hysteresis:
                self.scale *= self.backoff
                self.overflows = 0
                if self.min_scale is not None:
                    self.scale = max(self.scale, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= self.growth
                self.overflows = 0
                if self.max_scale is not None:
                    self.scale = min(self.scale, self.max_scale)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)
