"""Losses that accept vocab-sharded logits (the output of a tensor-parallel LM head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _collectives as C
from ._placement import dim_block


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Softmax in at least float32 (bf16/fp16 logits are upcast; float64 stays)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def cross_entropy(logits, labels: torch.Tensor, ignore_index: int = -100,
                  num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean token cross-entropy of ``logits`` (..., V) against ``labels`` (...).

    ``logits`` may be a DTensor sharded over the vocabulary (``Shard(-1)``, uneven
    allowed): then the softmax is computed in parallel (a max, a sum-exp and a target
    all-reduce over the tensor-parallel group) and the full logits never exist.
    ``num_items`` divides the summed loss instead of the count of labelled tokens
    (transformers' ``num_items_in_batch``, for gradient accumulation).
    """
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(logits, DTensor) and (len(logits.placements) != 1 or
                                        logits.placements[0] != Shard(logits.ndim - 1)):
        logits = logits.full_tensor()
    if not isinstance(logits, DTensor):
        y = labels.flatten().to(logits.device)
        total = F.cross_entropy(_wide(logits.flatten(0, -2)), y, ignore_index=ignore_index,
                                reduction="sum")
        return total / _count(y, ignore_index, num_items)
    import torch.distributed as dist

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
    return (per_tok * valid).sum() / _count(y, ignore_index, num_items)


def _count(y: torch.Tensor, ignore_index: int, num_items):
    if num_items is not None:
        return num_items.to(y.device) if isinstance(num_items, torch.Tensor) else num_items
    return (y != ignore_index).sum().clamp(min=1)


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


def hf_loss(kind: str):
    """transformers' ``loss_function`` for ``kind`` (``'ForCausalLM'``, ``'ForMaskedLM'``)
    on ``cross_entropy``, so ``model(input_ids=x, labels=x).loss`` reads vocab-sharded
    logits; the same arguments and results as transformers' own."""
    def causal(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
               shift_labels=None, **kwargs):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return cross_entropy(logits, shift_labels, ignore_index, num_items_in_batch)

    def masked(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
               **kwargs):
        return cross_entropy(logits, labels, ignore_index, num_items_in_batch)

    return {"ForCausalLM": causal, "ForConditionalGeneration": causal,
            "ForMaskedLM": masked}.get(kind)
