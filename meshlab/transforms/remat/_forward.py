"""Checkpointing one block's forward, as ``remat`` installs it (and ``calibrate`` times it):
``full`` keeps the block's input, ``selective`` also keeps matmul and attention outputs
(torch's fused attention kernels' and meshlab's attention op's)."""

from __future__ import annotations

import functools

import torch


def remat_forward(forward, policy: str, seen: list | None = None):
    """``forward`` under checkpointing; ``seen[0]`` counts the ops selective
    checkpointing's policy is asked about (forward and recompute), ``seen[1]`` those of
    them that are meshlab's fused ops."""
    from torch.utils.checkpoint import checkpoint

    context_fn = None
    if policy == "selective":
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        from ... import ops  # noqa: F401  (registers meshlab::attention)

        keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default,
                torch.ops.aten._scaled_dot_product_flash_attention.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default,
                torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                torch.ops.meshlab.attention.default,
                torch.ops.meshlab.flash_attention_4.default}

        def policy_fn(ctx, op, *args, **kwargs):
            if seen is not None:
                seen[0] += 1
                seen[1] += getattr(op, "namespace", "") == "meshlab"
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        kw = {"use_reentrant": False}
        if context_fn is not None:
            kw["context_fn"] = context_fn
        return checkpoint(forward, *args, **kw, **kwargs)

    return wrapped
