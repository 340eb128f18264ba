"""``step``: one training step of a parallelized model — microbatches, mixed precision,
loss scaling, and the pipeline schedule where a room runs the step itself."""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ._errors import ConfigError
from ._optimizer import MeshOptimizer
from .parallel._install import runtime_of


def _split(batch, k: int) -> list:
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % k:
            raise ConfigError(f"step(microbatches={k}): local batch size {batch.shape[0]} does "
                              f"not divide into {k} microbatches")
        return list(batch.chunk(k))
    if isinstance(batch, Mapping):
        parts = {key: _split(v, k) if isinstance(v, torch.Tensor) else [v] * k
                 for key, v in batch.items()}
        return [{key: parts[key][i] for key in batch} for i in range(k)]
    raise ConfigError(f"step: batch must be a tensor or a dict of tensors, got {type(batch).__name__}")


def step(model: nn.Module, opt: MeshOptimizer, batch, loss_fn: Callable | None = None, *,
         microbatches: int = 1) -> float:
    """One training step: forward/backward over ``microbatches`` slices of this rank's
    ``batch``, then ``opt.step()`` and ``opt.zero_grad()``. Returns the loss averaged
    over microbatches and data-parallel ranks (the single-process loss of the global batch).

    ``loss_fn(output, batch) -> loss`` defaults to the causal-LM loss.
    """
    from .losses import causal_lm_loss

    rt = runtime_of(model)
    fused = getattr(model, "_meshlab_fused_loss", False)
    if fused and loss_fn is not None:
        raise ConfigError("this model's loss is fused (fuse('loss')): its head returns the "
                          "causal-LM loss, not logits, so a loss_fn cannot run; leave 'loss' "
                          "out of fuse() to pass one")
    loss_fn = loss_fn or causal_lm_loss
    for part in rt.parts:
        done = part.run_step(rt, opt, batch, loss_fn)
        if done is not None:
            return done
    mbs = _split(batch, microbatches)
    total = 0.0
    for i, mb in enumerate(mbs):
        for part in rt.parts:
            part.set_gradient_sync(model, i == len(mbs) - 1)
        with rt.autocast():
            # Labels go to loss_fn, not to the model (a Hugging Face model would compute
            # its own, non-parallel loss from them).
            if fused:
                from .parallel.fuse import causal_lm_loss as fused_causal_lm_loss

                loss = fused_causal_lm_loss(model, mb) / len(mbs)
            else:
                out = model(**{k: v for k, v in mb.items() if k != "labels"}) \
                    if isinstance(mb, Mapping) else model(mb)
                loss = loss_fn(out, mb) / len(mbs)
        scaled = loss * opt.scaler.scale if opt.scaler is not None else loss
        scaled.backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad()
    if rt.dp_group is not None and rt.dp_size > 1:
        t = torch.tensor([total], dtype=torch.float64, device=rt.device)
        dist.all_reduce(t, group=rt.dp_group)
        total = float(t) / rt.dp_size
    return total


