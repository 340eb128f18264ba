"""Losses that accept vocab-sharded logits (the output of a tensor-parallel LM head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _collectives as C
from ._placement import dim_block


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Softmax in at least float32 (bf16/fp16 logits are upcast; float64 stays)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def cross_entropy(logits, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy of ``logits`` (..., V) against ``labels`` (...).

    ``logits`` may be a DTensor sharded over the vocabulary (``Shard(-1)``, uneven
    allowed): then the softmax is computed in parallel (a max, a sum-exp and a target
    all-reduce over the tensor-parallel group) and the full logits never exist.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(logits, DTensor):
        return F.cross_entropy(_wide(logits.flatten(0, -2)), labels.flatten(),
                               ignore_index=ignore_index)
    import torch.distributed as dist

    if len(logits.placements) != 1 or logits.placements[0] != Shard(logits.ndim - 1):
        return F.cross_entropy(_wide(logits.full_tensor().flatten(0, -2)), labels.flatten(),
                               ignore_index=ignore_index)
    mesh = logits.device_mesh
    group = mesh.get_group()
    n, r = mesh.size(), mesh.get_local_rank()
    vocab = logits.shape[-1]
    lo, cnt = dim_block(vocab, [n], [r])
    local = _wide(logits.to_local().flatten(0, -2))          # (N, V/n)
    y = labels.flatten()
    valid = y != ignore_index
    with torch.no_grad():
        m = local.max(dim=-1).values if cnt else local.new_full((local.shape[0],), -torch.inf)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sumexp = C.reduce_from_region(torch.exp(local - m.unsqueeze(-1)).sum(-1), group)
    mine = (y >= lo) & (y < lo + cnt) & valid
    idx = (y - lo).clamp(0, max(cnt - 1, 0)).unsqueeze(-1)
    tgt = local.gather(-1, idx).squeeze(-1) * mine if cnt else local.new_zeros(y.shape)
    tgt = C.reduce_from_region(tgt, group)
    per_tok = torch.log(sumexp) + m - tgt
    return (per_tok * valid).sum() / valid.sum().clamp(min=1)


def causal_lm_loss(output, batch) -> torch.Tensor:
    """Next-token loss: ``output.logits`` (B, S, V) against ``batch['labels']`` shifted by
    one (or ``input_ids`` when there are no labels); -100 is ignored."""
    logits = output.logits if hasattr(output, "logits") else output
    labels = batch.get("labels", batch["input_ids"])
    return cross_entropy(logits[:, :-1], labels[:, 1:])


def masked_lm_loss(output, batch) -> torch.Tensor:
    """Masked-LM loss: ``output.logits`` (B, S, V) against ``batch['labels']`` (-100 ignored)."""
    logits = output.logits if hasattr(output, "logits") else output
    return cross_entropy(logits, batch["labels"])
