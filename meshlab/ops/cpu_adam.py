"""AdamW for parameters that live in CPU memory (optimizer offload), stepped by one C++ loop.

:class:`CPUAdamW` keeps ``torch.optim.AdamW``'s state layout (``step``, ``exp_avg``,
``exp_avg_sq``) and its arithmetic (decoupled weight decay, bias correction), so a state
dict moves between the two. Its step hands every float32 CPU parameter of a group to
``csrc/cpu_adam.cpp`` in one call: one OpenMP loop that reads and writes each element once,
where the unfused update makes several passes over memory. Gradients may be float32 or
bfloat16 (read as they are, converted in the loop). Parameters that are not
contiguous float32 CPU tensors, or a machine where the extension cannot be built, take
:func:`adamw_reference` instead (same numbers, more passes).

>>> import torch
>>> from meshlab.ops import CPUAdamW
>>> w = torch.nn.Parameter(torch.ones(4))
>>> opt = CPUAdamW([w], lr=0.1)
>>> w.sum().backward(); opt.step()
>>> w.detach()
tensor([0.8990, 0.8990, 0.8990, 0.8990])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _build
from ._build import cpu_adam_kernels as cpu_adam_kernels


def adamw_reference(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    step: int) -> None:
    """One AdamW update in place, in torch.optim.AdamW's order of operations."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


class CPUAdamW(torch.optim.Optimizer):
    """AdamW whose step runs a vectorized, multithreaded C++ loop over float32 CPU params.

    Arguments are ``torch.optim.AdamW``'s: ``lr`` (1e-3), ``betas`` ((0.9, 0.999)), ``eps``
    (1e-8) and ``weight_decay`` (1e-2, decoupled: ``p *= 1 - lr * weight_decay``).
    ``native`` is False after a step that ran the reference because the extension could not
    be built; ``fallback_reason`` then says why.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"CPUAdamW: need lr, eps, weight_decay >= 0 and 0 <= betas < 1; "
                             f"got lr={lr}, eps={eps}, weight_decay={weight_decay}, "
                             f"betas={betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.native: bool | None = None
        self.fallback_reason: str | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self.native = step_group(self.state, group, group["params"])
            self.fallback_reason = None if self.native else _fallback_reason()
        return loss


def _fallback_reason() -> str | None:
    return _build.native_disabled_reason() or _build.failure("meshlab_cpu_adam")


def init_state(state: dict, p: Tensor) -> dict:
    """``torch.optim.AdamW``'s state layout for ``p``, created on first use."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def step_group(states, group: dict, params, outs: dict | None = None,
               grads: dict | None = None) -> bool:
    """One AdamW update of ``params`` (CPU tensors of one param group, gradients in
    ``.grad``, float32 or bfloat16) with ``states[p]`` in ``torch.optim.AdamW``'s layout.
    ``outs`` maps a parameter to a bfloat16 CPU tensor that receives the updated values
    (the copy an offloaded step sends back to the device); ``grads`` maps a parameter to
    its gradient where ``.grad`` cannot hold it (a bfloat16 gradient of a float32
    parameter). Returns whether the C++ loop
    ran (else the reference did, for every parameter)."""
    kernels = cpu_adam_kernels()
    beta1, beta2 = group["betas"]
    outs, grads = outs or {}, grads or {}
    # Parameters at one step count share the scalars, and so one kernel call.
    batches: dict[int, list[tuple[Tensor, ...]]] = {}
    for p in params:
        g = p.grad if p.grad is not None else grads.get(p)
        if g is None:
            continue
        if g.is_sparse:
            raise RuntimeError("CPUAdamW does not support sparse gradients; use "
                               "torch.optim.SparseAdam")
        state = init_state(states[p], p)
        state["step"] += 1
        step = int(state["step"].item())
        t = (p, g, state["exp_avg"], state["exp_avg_sq"])
        out = outs.get(p)
        fast = kernels is not None and all(
            x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            for x in (p, t[2], t[3])) and g.device.type == "cpu" and \
            g.dtype in (torch.float32, torch.bfloat16) and g.is_contiguous()
        if fast:
            batches.setdefault(step, []).append(t + (out,))
            continue
        adamw_reference(p, g.to(p.dtype), t[2], t[3], lr=group["lr"], beta1=beta1,
                        beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                        step=step)
        if out is not None:
            out.copy_(p)
    for step, items in batches.items():
        with_out = [x for x in items if x[4] is not None]
        for sel, o in ((with_out, [x[4] for x in with_out]),
                       ([x for x in items if x[4] is None], [])):
            if not sel:
                continue
            ps, gs, ms, vs = (list(col) for col in zip(*(x[:4] for x in sel)))
            kernels.adamw_step(ps, gs, ms, vs, group["lr"], beta1, beta2, group["eps"],
                               group["weight_decay"], group["lr"] / (1 - beta1 ** step),
                               math.sqrt(1 - beta2 ** step), o)
    return kernels is not None
