"""Colossal-AI's wrapper types of what ``boost`` returns: the optimizer is an
``OptimizerWrapper`` (``meshlab.optimizer`` with Colossal-AI's methods), the model a
``ModelWrapper`` (the parallelized module itself, with ``unwrap()``).

``boost`` keeps the model the object it was: its class becomes a subclass of its own
class and ``ModelWrapper`` (as FSDP2's ``fully_shard`` makes it a subclass of
``FSDPModule``), so ``isinstance(model, LlamaForCausalLM)`` still holds.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import ConfigError
from ..train.optimizer import MeshOptimizer


class OptimizerWrapper(MeshOptimizer):
    """The optimizer ``boost`` returns: ``meshlab.optimizer`` plus Colossal-AI's
    ``backward``, ``clip_grad_by_norm``, ``get_grad_norm``, ``unwrap``, ``optim`` and
    ``state_dict(only_rank_0=...)``."""

    def state_dict(self, only_rank_0: bool | None = None) -> dict:
        """meshlab's optimizer ``state_dict``; with ``only_rank_0`` given (Gemini's
        argument), every state tensor whole, gathered over the mesh (every rank must call
        it), on rank 0 only when True (the other ranks get ``{}``). ZeRO-1's flat slices
        are not DTensors and are refused here: ``meshlab.checkpoint.save`` gathers them."""
        d = super().state_dict()
        if only_rank_0 is None:
            return d
        if self.shards:
            raise ConfigError("optimizer.state_dict(only_rank_0=...): ZeRO-1 keeps its state "
                              "as flat slices of its own; save it with booster.save_optimizer "
                              "(meshlab.checkpoint.save), which gathers them")
        from torch.distributed.tensor import DTensor

        def whole(v):
            return v.full_tensor() if isinstance(v, DTensor) else v

        state = {k: {n: whole(v) for n, v in st.items()} for k, st in d["state"].items()}
        if only_rank_0 and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return {**d, "state": state}

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The torch optimizer inside (it steps the sharded tensors)."""
        return self.inner

    def unwrap(self) -> torch.optim.Optimizer:
        return self.inner

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """``loss.backward()``, scaled by the loss scale under fp16."""
        self.scale(loss).backward(*args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor, *args, **kwargs):
        torch.autograd.backward(tensor, self.scale(grad), *args, **kwargs)

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs) -> float | None:
        """The global gradient norm of the last step (None where the step computed none:
        no clipping and no ``nonfinite`` check)."""
        if norm_type != 2.0:
            raise ConfigError(f"get_grad_norm(norm_type={norm_type!r}): the 2-norm only")
        return self.last_grad_norm

    @torch.no_grad()
    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0,
                          error_if_nonfinite: bool = False, **kwargs) -> float:
        """Scale the gradients so that their global 2-norm (over every mesh axis, loss
        scale removed) is at most ``max_norm``; returns the norm before clipping."""
        if norm_type != 2.0:
            raise ConfigError(f"clip_grad_by_norm(norm_type={norm_type!r}): the 2-norm only")
        self._sync_grads()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        norm = self.grad_norm() / scale
        if error_if_nonfinite and not torch.isfinite(torch.tensor(norm)):
            raise ConfigError(f"clip_grad_by_norm: the global gradient norm is {norm}")
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g, _ in self._grad_items():
                g.mul_(coef)
        self.last_grad_norm = norm
        return norm


class ModelWrapper:
    """What ``boost`` mixes into the model's class: Colossal-AI's ``unwrap()`` and
    ``state_dict(only_rank_0=...)``. There is no ``.module``: meshlab wraps no module in
    another (and Hugging Face's ``unwrap_model`` would follow a ``.module`` that is the
    model itself forever); use the model, or ``model.unwrap()``."""

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The model (its parameters are the sharded ones: meshlab wraps nothing)."""
        return self

    def state_dict(self, *args, only_rank_0: bool | None = None, **kwargs):
        """torch's ``state_dict``; with ``only_rank_0`` given, every tensor whole (gathered
        over the mesh: every rank must call it), on rank 0 only when True."""
        sd = super().state_dict(*args, **kwargs)
        if only_rank_0 is None:
            return sd
        from torch.distributed.tensor import DTensor

        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
        if only_rank_0 and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return full


@functools.cache
def _wrapped_class(cls: type) -> type:
    return type(cls.__name__, (ModelWrapper, cls), {"__module__": cls.__module__,
                                                    "__qualname__": cls.__qualname__})


def wrap_model(model: nn.Module) -> nn.Module:
    """``model``, its class now a ``ModelWrapper`` subclass of its own class."""
    if not isinstance(model, ModelWrapper):
        model.__class__ = _wrapped_class(type(model))
    return model
