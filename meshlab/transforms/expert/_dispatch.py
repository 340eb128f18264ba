"""The experts forward under expert parallelism: dispatch, local experts, combine.

Registered in transformers' ``ExpertsInterface`` as ``"meshlab_ep"``, it replaces the
*implementation* of a family's experts module, never its model code: the router and
everything around the experts run as the family wrote them, and the local experts run
through the implementation the model had chosen before (``grouped_mm`` — one grouped
matmul, ``torch._grouped_mm`` on the GPU — or the eager loop), on this rank's slice of
the expert weights.

Per call, with ``T`` local tokens, top-``k`` routing, ``E`` experts over ``n`` ranks
(``L = E / n`` each):

1. the ``T*k`` (token, expert) pairs are sorted by expert (stably);
2. dropless (the default): the per-expert counts are exchanged (one all-to-all of ``E``
   integers), so each rank knows how many rows it receives for each of its experts (the
   split sizes are read on the host); with ``capacity_factor``: every rank sends every
   expert exactly ``capacity`` rows, zeros where it has fewer, so the splits are known in
   advance and nothing waits on the device; pairs past an expert's capacity (in token
   order) are dropped and counted;
3. the rows go to the ranks holding their experts (all-to-all), are regrouped by local
   expert and run through the local experts with weight 1;
4. the results come back (the reverse all-to-all), are weighted by the router's
   probabilities and summed per token.

Gradients follow the same path backwards. The expert weights' gradient is scaled by
``1/n``: each rank's loss is the mean over its own tokens and the model's loss is their
mean (as for the dense weights, whose gradients are averaged over ``n``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...core.sections import boundary
from ...core.tensors import scale_grad

IMPL = "meshlab_ep"
_EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias",
                  "up_proj_bias", "down_proj_bias")


@dataclasses.dataclass
class EPStats:
    """What the exchanges moved since the last ``reset``: all-to-all calls, rows and
    bytes that left this rank (forward and backward), (token, expert) pairs routed, those
    whose expert is on another rank (``away``), and those dropped over capacity."""

    all_to_all: int = 0
    rows: int = 0
    bytes: int = 0
    routed_on_host: int = 0
    away: int = 0
    dropped_on_device: list = dataclasses.field(default_factory=list)   # counts, unread
    # pairs routed where every expert is on this rank: a tensor, so that a compiled block
    # adds to it in its graph (a Python int there is a constant dynamo guards on: every
    # step would compile the block again)
    routed_on_device: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.zeros((), dtype=torch.int64))

    @property
    def routed(self) -> int:
        """(token, expert) pairs routed (reading it waits for the device)."""
        return self.routed_on_host + int(self.routed_on_device)

    @property
    def dropped(self) -> int:
        """Pairs dropped over capacity (reading it waits for the device)."""
        return int(sum(int(d) for d in self.dropped_on_device))

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "routed_on_device":
                self.routed_on_device.zero_()         # the same tensor: graphs hold it
            else:
                setattr(self, f.name, [] if f.name == "dropped_on_device" else 0)


@dataclasses.dataclass
class EPState:
    """One experts module's expert-parallel setup."""

    group: Any
    size: int
    rank: int
    impl: str | None                 # the implementation the local experts run with
    capacity_factor: float | None
    stats: EPStats


def attach_state(module: nn.Module, st: EPState) -> None:
    """Give an experts module its expert-parallel setup, which ``ep_experts_forward``
    (its implementation from now on) reads."""
    module._meshlab_ep = st


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks (``in_splits`` sent, ``out_splits`` received); the backward
    sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, st):
        ctx.out_splits, ctx.in_splits, ctx.st = out_splits, in_splits, st
        return _exchange(x.contiguous(), out_splits, in_splits, st)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g.contiguous(), ctx.in_splits, ctx.out_splits, ctx.st), None, None, None


def _exchange(x, out_splits, in_splits, st):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=st.group)
    away = sum(in_splits) - in_splits[st.rank]          # rows that leave this rank
    st.stats.all_to_all += 1
    st.stats.rows += away
    st.stats.bytes += away * (x.numel() // max(x.shape[0], 1)) * x.element_size()
    return out


class _Local:
    """The experts module seen with this rank's slice of the weights: attributes the
    implementation reads come from the module unless overridden here."""

    def __init__(self, module: nn.Module, **overrides):
        # attribute by attribute: a compiled block traces this (dynamo of torch 2.11
        # cannot trace ``self.__dict__.update``)
        self._module = module
        for name, value in overrides.items():
            setattr(self, name, value)

    def __getattr__(self, name):          # only for names not set above
        return getattr(self._module, name)


def _local_weights(module: nn.Module, n: int) -> dict:
    out = {}
    for name in _EXPERT_PARAMS:
        p = module._parameters.get(name)
        if p is None:
            continue
        loc = p.to_local() if hasattr(p, "to_local") else p
        out[name] = scale_grad(loc, 1.0 / n) if n > 1 else loc
    return out


def _run_local(module, st: EPState, x, local_ids, n_local: int, weights=None):
    """The family's own experts implementation over the local experts: each row of ``x``
    to the expert ``local_ids`` names with weight 1, or (``weights`` given) the routing of
    ``local_ids`` (top-k indices) with its weights."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    eager = type(module).forward.__wrapped__
    fn = eager if st.impl in (None, "eager") else \
        ALL_EXPERTS_FUNCTIONS.get_interface(st.impl, eager)
    proxy = _Local(module, num_experts=n_local, _is_expert_parallel=False,
                   **_local_weights(module, st.size))
    if weights is not None:
        return fn(proxy, x, local_ids, weights)
    ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
    return fn(proxy, x, local_ids.unsqueeze(-1), ones)


def ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    st: EPState = self._meshlab_ep
    n, E = st.size, self.num_experts
    if n == 1 and st.capacity_factor is None:
        # every expert here: nothing to exchange (so nothing to agree on before it), the
        # family's own path runs, and a compiled block traces it with the rest
        st.stats.routed_on_device.add_(top_k_index.numel())
        return _run_local(self, st, hidden_states, top_k_index, E, top_k_weights)
    # The expert ranks read different tokens, so one of them may have raised since the
    # last exchange (its loop then skips the batch): in a training forward every rank
    # agrees it got here before the all-to-all waits for it (``core.sections``). Once
    # per call: between its exchanges only this module's code and the local experts run,
    # and another agreement there would double the cost for a failure that rare.
    boundary("expert dispatch")
    if st.capacity_factor is not None:
        return _capacity_forward(self, st, hidden_states, top_k_index, top_k_weights)
    L = E // n
    T, k = top_k_index.shape
    dev = hidden_states.device
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    ids_s, tok = ids[order], order // k
    w = top_k_weights.reshape(-1)[order]
    counts = torch.bincount(ids_s, minlength=E)
    st.stats.routed_on_host += ids.numel()
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=st.group)
    st.stats.all_to_all += 1
    send = counts.view(n, L).sum(1).tolist()
    recv_mat = recv_counts.view(n, L)
    recv = recv_mat.sum(1).tolist()
    st.stats.away += sum(send) - send[st.rank]
    x = _AllToAll.apply(hidden_states[tok], recv, send, st)
    local_ids = torch.repeat_interleave(torch.arange(L, device=dev).repeat(n),
                                        recv_mat.reshape(-1))
    lo = torch.argsort(local_ids, stable=True)
    y = _run_local(self, st, x[lo], local_ids[lo], L)
    if x.requires_grad and not y.requires_grad:
        # no row came here (an implementation that loops over the experts hit then never
        # reads x): the exchanges stay in the graph, so this rank's backward runs their
        # all-to-alls with the others' and its own rows sent away get their gradients
        y = y + x[lo] * 0
    y = y.new_zeros(y.shape).index_copy(0, lo, y)          # back to the order received
    y = _AllToAll.apply(y, send, recv, st)
    y = y * w.unsqueeze(-1).to(y.dtype)
    out = torch.zeros(T, y.shape[-1], dtype=y.dtype, device=dev).index_add(0, tok, y)
    return out.to(hidden_states.dtype)


def capacity(factor: float, pairs: int, experts: int) -> int:
    """Rows each rank may send each expert: ``ceil(factor * pairs / experts)``."""
    return max(1, math.ceil(factor * pairs / experts))


def _capacity_forward(self, st: EPState, hidden_states, top_k_index, top_k_weights):
    """The fixed-size path: every rank sends every expert exactly ``capacity`` rows
    (zeros where it has fewer), so both exchanges have equal splits known in advance and
    nothing waits on the device. Pairs past an expert's capacity, in token order, are
    dropped: their contribution is zero, and ``stats.dropped`` counts them."""
    n, E = st.size, self.num_experts
    L = E // n
    T, k = top_k_index.shape
    H = hidden_states.shape[-1]
    dev = hidden_states.device
    cap = capacity(st.capacity_factor, T * k, E)
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    ids_s, tok = ids[order], order // k
    w = top_k_weights.reshape(-1)[order]
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(
        0, ids_s, torch.ones_like(ids_s))
    starts = torch.cumsum(counts, 0) - counts
    slot_in_expert = torch.arange(ids_s.numel(), device=dev) - starts[ids_s]
    kept = slot_in_expert < cap
    slots = torch.where(kept, ids_s * cap + slot_in_expert, E * cap)     # E*cap: the bin
    st.stats.routed_on_host += ids.numel()
    st.stats.dropped_on_device.append((~kept).sum())
    send = hidden_states.new_zeros(E * cap + 1, H).index_copy(0, slots, hidden_states[tok])
    splits = [L * cap] * n
    x = _AllToAll.apply(send[:-1], splits, splits, st)                  # [n, L, cap] rows
    local_ids = torch.arange(L, device=dev).repeat_interleave(cap).repeat(n)
    lo = torch.argsort(local_ids, stable=True)
    y = _run_local(self, st, x[lo], local_ids[lo], L)
    y = y.new_zeros(y.shape).index_copy(0, lo, y)
    y = _AllToAll.apply(y, splits, splits, st)
    y = torch.cat([y, y.new_zeros(1, H)])[slots]                          # the bin reads 0
    y = y * (w * kept).unsqueeze(-1).to(y.dtype)
    out = torch.zeros(T, H, dtype=y.dtype, device=dev).index_add(0, tok, y)
    return out.to(hidden_states.dtype)
