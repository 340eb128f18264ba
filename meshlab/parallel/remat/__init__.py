"""remat: activation checkpointing of the repeated blocks.

The room: ``Remat`` (a plan value) and its install (each block's ``forward`` wrapped in
``torch.utils.checkpoint``; ``selective`` keeps the matmul outputs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch

from ..._errors import check_choice
from .._protocol import Phase, Transform

POLICIES = ("none", "full", "selective")


@dataclasses.dataclass(frozen=True)
class Remat(Transform):
    """Recompute activations in backward. ``full`` keeps only each block's input;
    ``selective`` also keeps matmul outputs (recomputes the cheap elementwise ops)."""

    kind: ClassVar[str] = "remat"
    phase: ClassVar[Phase] = Phase.REMAT

    policy: str = "full"

    def __post_init__(self):
        check_choice(self.policy, "remat", "policy", POLICIES)

    def install(self, ctx) -> None:
        if self.policy == "none":
            return None
        cfg = getattr(ctx.model, "config", None)
        if getattr(cfg, "use_cache", False):
            # A KV cache would grow again on every recomputed block (HF does the same).
            cfg.use_cache = False
        mods = dict(ctx.model.named_modules())
        for b in (b for b in ctx.plan.model.blocks if b in mods and b not in ctx.dropped):
            mods[b].forward = _remat_forward(mods[b].forward, self.policy)
        return None

    def profile(self, plan, model) -> None:
        if self.policy == "none":
            return None
        for b in plan.model.blocks[:1]:
            m = model.get_submodule(b)
            m.forward = _remat_forward(m.forward, self.policy)
        return None

    def __repr__(self) -> str:
        return f"remat({self.policy!r})"


def remat(policy: str = "full") -> Remat:
    """Activation checkpointing for every repeated block (``'none'|'full'|'selective'``).

    >>> remat('selective')
    remat('selective')
    """
    return Remat(policy)


def _remat_forward(forward, policy: str):
    from torch.utils.checkpoint import checkpoint

    context_fn = None
    if policy == "selective":
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default,
                torch.ops.aten._scaled_dot_product_flash_attention.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default}

        def policy_fn(ctx, op, *args, **kwargs):
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
