"""The router's load-balancing loss over the global batch.

A family's ``load_balancing_loss_func`` (Switch Transformer's ``E * sum_e f_e * P_e``:
``f_e`` the fraction of (token, top-k) assignments to expert ``e``, ``P_e`` its mean
router probability) reads the batch it is given. Under expert (and data) parallelism each
rank holds part of the batch, so the same function would compute a different, local
loss. Inside a parallelized forward, meshlab's version sums the two statistics and the
row count over the data axes first (the probabilities through a differentiable
all-gather), so every rank gets the loss of the whole batch: what the single process
computes. Outside it (any other model in the process) the family's function runs as is.
"""

from __future__ import annotations

import contextvars
import functools
import sys

import torch
import torch.nn.functional as F

from ...planning.roles import block_sequence_axes

_GROUP: contextvars.ContextVar = contextvars.ContextVar("meshlab_aux_group", default=None)


def _local_mask(mask: torch.Tensor, rows: int, seq) -> torch.Tensor:
    """``mask`` (B, S) cut to the tokens this rank's router saw: under Megatron sequence
    parallelism (``seq``: this rank's position and the ranks along the sequence) each
    holds one contiguous part of every row's sequence."""
    if mask.numel() == rows or seq is None or mask.dim() != 2:
        return mask
    pos, n = seq
    s = mask.shape[1]
    if s % n or mask.numel() != rows * n:
        return mask
    return mask[:, pos * (s // n):(pos + 1) * (s // n)]


def global_load_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None,
                               *, group, grad_scale: float = 1.0, seq=None):
    from torch.distributed._functional_collectives import all_gather_single_autograd

    from ...core.errors import ConfigError

    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    if attention_mask is not None:
        attention_mask = _local_mask(attention_mask, gate_logits[0].shape[0], seq)
        if attention_mask.numel() != gate_logits[0].shape[0]:
            raise ConfigError(
                f"the router's load-balancing loss: attention_mask holds "
                f"{attention_mask.numel()} tokens and the router saw {gate_logits[0].shape[0]} "
                f"on this rank; pass the mask of this rank's batch (B, S), or no mask")
    dev = gate_logits[0].device
    # float32 at least, and float64 for a float64 model, as the family's own function
    # computes in the logits' dtype
    acc = torch.promote_types(gate_logits[0].dtype, torch.float32)
    counts = torch.zeros(num_experts, dtype=acc, device=dev)
    probs = torch.zeros(num_experts, dtype=acc, device=dev)
    rows = torch.zeros((), dtype=acc, device=dev)
    mask = None if attention_mask is None else \
        attention_mask.reshape(-1).to(device=dev, dtype=acc)
    for layer in gate_logits:
        w = F.softmax(layer.to(dev), dim=-1)
        _, sel = torch.topk(w, top_k, dim=-1)
        m = torch.ones(w.shape[0], dtype=acc, device=dev) if mask is None else mask
        counts = counts.scatter_add(0, sel.reshape(-1), m.repeat_interleave(top_k))
        probs = probs + (w.to(acc) * m.unsqueeze(-1)).sum(0)
        rows = rows + m.sum()
    if grad_scale != 1.0:
        # the same value; the gradient scaled (the all-reduce's backward sums it over every
        # rank of the group, and only the data ranks average it afterwards)
        probs = probs * grad_scale + probs.detach() * (1.0 - grad_scale)
    stats = torch.cat([counts, rows.reshape(1)]).detach()
    torch.distributed.all_reduce(stats, group=group)
    # the ranks' sums gathered and added (differentiable: the backward hands each rank
    # the sum over the ranks of its row's gradient, as an all-reduce's backward does)
    probs = all_gather_single_autograd(probs[None], 0, group).sum(0)
    counts, rows = stats[:-1], stats[-1]
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def patch_family(module_cls: type) -> bool:
    """Route ``module_cls``'s modeling file's ``load_balancing_loss_func`` through the
    global version inside parallelized forwards; False if the file has none."""
    mod = sys.modules.get(module_cls.__module__)
    fn = getattr(mod, "load_balancing_loss_func", None)
    if fn is None:
        return False
    if getattr(fn, "_meshlab_global", False):
        return True

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        scope = _GROUP.get()
        if scope is None:
            return fn(*args, **kwargs)
        group, scale, seq = scope
        return global_load_balancing_loss(*args, **kwargs, group=group, grad_scale=scale,
                                          seq=seq)

    dispatch._meshlab_global = True
    mod.load_balancing_loss_func = dispatch
    return True


def scope_forward(model, group, grad_scale: float = 1.0, seq=None) -> None:
    """The model's forward computes the loss over every token of ``group`` (set for the
    call). ``grad_scale``: the data ranks' share of the group (1 / the tensor-parallel size
    under Megatron sequence parallelism, whose ranks hold other tokens but do not average
    their gradients); ``seq``: (this rank's position, the ranks) along that sequence
    split, whose part of the attention mask is this rank's."""
    tokens = []

    def pre(_m, _args):
        tokens.append(_GROUP.set((group, grad_scale, seq)))

    def post(_m, _args, _out):
        if tokens:
            _GROUP.reset(tokens.pop())

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post, always_call=True)


def scope_router_loss(ctx) -> None:
    """Any layout that cuts the batch (data parallelism, ZeRO, ``expert_route``, Megatron
    sequence parallelism): a mixture of experts' router load-balancing loss is taken over
    every token of the step, as one process takes it, where each rank would take it over
    its own: those of the data ranks, and under Megatron sequence parallelism those of the
    tensor-parallel ranks, each of which routes its own part of the sequence. Nothing for
    a model whose modeling files have no ``load_balancing_loss_func``."""
    # each module's own class (ZeRO's FSDP2 gives a module a subclass of its own module)
    classes = {c for m in ctx.model.modules() for c in type(m).__mro__[:-1]}
    if not [c for c in classes if patch_family(c)]:     # every file patched, not the first
        return
    seq = tuple(a for a in block_sequence_axes(ctx.plan) if a not in ctx.roles.data)
    axes = tuple(a for a in ctx.plan.mesh_shape if a in ctx.roles.data + seq)   # mesh order
    if axes and ctx.size(*axes) > 1:
        pos = 0
        for a in (a for a in ctx.plan.mesh_shape if a in seq):       # the first major
            pos = pos * ctx.size(a) + ctx.coordinate(a)
        scope_forward(ctx.model, ctx.group(*axes), 1.0 / ctx.size(*seq) if seq else 1.0,
                      (pos, ctx.size(*seq)) if seq else None)
