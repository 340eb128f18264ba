"""The paged KV cache and the attention that reads it, behind transformers'
``AttentionInterface``.

``PagedCache`` holds, per attention layer, ``k`` and ``v`` tensors of shape
``(num_blocks, block_size, Hkv, D)``, allocated at a layer's first write with the heads
that layer computes on this rank (under tensor parallelism: this rank's K/V heads, so the
cache is sharded over tp by heads with no code of its own); ``copy_blocks`` copies whole
blocks in every layer (a beam forking from its parent). ``Blocks`` hands out block
numbers. A step of the engine runs the model on all its sequences' new tokens packed in
one row (``input_ids`` (1, T), ``position_ids`` (1, T)) inside ``running(batch)``; each
attention layer then stores its new keys and values at the batch's slots and attends
through ``meshlab::paged_attention`` (a decode step on CUDA: both in one launch,
``meshlab::paged_decode``). The model's own mask is not used: the mask function
registered with the attention gives ``None``, and the op masks causally per sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import torch
from torch import Tensor

from ..core.errors import ConfigError
from ..ops.paged_attention import Layout, write_and_attend

NAME = "meshlab_paged"
_RUNNING = threading.local()


class Blocks:
    """Free block numbers of a cache of ``n`` blocks."""

    def __init__(self, n: int):
        self.n, self.free = n, list(range(n - 1, -1, -1))

    def take(self, k: int) -> list[int]:
        if k > len(self.free):
            raise ConfigError(f"paged cache: {k} blocks asked, {len(self.free)} of {self.n} free")
        return [self.free.pop() for _ in range(k)]

    def give(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


class PagedCache:
    """Per-layer paged K/V tensors (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, dtype: torch.dtype | None):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.copied = 0            # blocks copied by copy_blocks, over every call

    def layer(self, idx: int, k: Tensor) -> tuple[Tensor, Tensor]:
        """The caches of layer ``idx``, made for keys like ``k`` (T, Hkv, D) on first use."""
        if idx not in self.k:
            shape = (self.num_blocks, self.block_size) + tuple(k.shape[1:])
            dt = self.dtype or k.dtype
            self.k[idx] = torch.zeros(shape, dtype=dt, device=k.device)
            self.v[idx] = torch.zeros(shape, dtype=dt, device=k.device)
        return self.k[idx], self.v[idx]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of blocks ``src`` into blocks ``dst`` (pairwise), in
        every layer this rank caches (a beam forking from its parent)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks: {len(src)} source blocks, {len(dst)} destinations")
        if not src:
            return
        index: dict = {}            # device -> (source, destination) indices, made once
        for d in (self.k, self.v):
            for t in d.values():
                if t.device not in index:
                    index[t.device] = (torch.tensor(src, device=t.device),
                                       torch.tensor(dst, device=t.device))
                i, j = index[t.device]
                t.index_copy_(0, j, t.index_select(0, i))
        self.copied += len(src)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


def place(r, p: int, bs: int, window: int | None) -> int:
    """The cache slot of sequence ``r``'s token at position ``p``. Under StreamingLLM
    (``window``: the blocks a decoding sequence holds) a generated token that would lie
    past them first evicts the oldest block after the first: it moves to the end of
    ``r.blocks``, to be written over, and ``r.dropped`` counts it. ``r.blocks`` then lists
    the kept blocks in key order: the first (the attention sinks), the window, the block
    being filled. A prompt's own tokens never evict (its prefill attends to all of it)."""
    if window is not None and p >= len(r.prompt):
        while p // bs - r.dropped > window - 1:
            r.blocks.append(r.blocks.pop(1))
            r.dropped += 1
    return r.blocks[p // bs - r.dropped if p >= bs else 0] * bs + p % bs


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Where one step's packed tokens go and what they read."""

    cache: PagedCache
    slots: Tensor              # (T,) flat slot of each new token
    block_tables: Tensor       # (S, max_blocks) int32
    seq_lens: list[int]        # keys of each sequence after this step's writes
    query_start: list[int]     # S + 1 offsets of each sequence's tokens in the row
    where: Layout              # the same as device tensors, made once for every layer


def current_batch() -> PagedBatch | None:
    """The batch of the engine step running on this thread, if any."""
    return getattr(_RUNNING, "batch", None)


@contextlib.contextmanager
def running(batch: PagedBatch):
    """The model's attention layers read and write ``batch`` inside this block."""
    prev = getattr(_RUNNING, "batch", None)
    _RUNNING.batch = batch
    try:
        yield
    finally:
        _RUNNING.batch = prev


_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks")


def paged_hf_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[Tensor, None]:
    """transformers ``AttentionInterface`` entry: query (1, Hq, T, D), key and value
    (1, Hkv, T, D) of the packed new tokens -> (attn_output (1, T, Hq, D), None)."""
    from torch.distributed.tensor import DTensor

    batch = current_batch()
    what = type(module).__name__
    if batch is None:
        raise ConfigError(f"{what}: attn_implementation={NAME!r} runs only inside "
                          f"meshlab.inference.InferenceEngine's steps; set the model's "
                          f"attention back (model.set_attn_implementation('sdpa'))")
    if isinstance(query, DTensor):
        raise ConfigError(f"{what}: the attention runs on DTensors (a model sharded by glob "
                          f"specs with no policy); the engine needs the family's policy: "
                          f"shard(policies.auto, rules)")
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ConfigError(f"{what} asks the paged attention for {name}={kwargs[name]!r}, "
                              f"which it does not implement; this family cannot be served by "
                              f"meshlab.inference yet")
    layer = getattr(module, "layer_idx", None)
    if query.shape[0] != 1 or layer is None:
        raise ConfigError(f"{what}: the paged attention needs packed tokens (batch 1) and a "
                          f"module with layer_idx; got batch {query.shape[0]}, layer_idx "
                          f"{layer}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))      # (T, H, D)
    kc, vc = batch.cache.layer(layer, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scaling is None else scaling
    return write_and_attend(q, kc, vc, batch.slots, k, v, batch.where, scale).unsqueeze(0), None


def register() -> str:
    """Register the paged attention with transformers as ``attn_implementation=NAME``.

    No mask function is registered with it: for such an implementation transformers'
    ``create_causal_mask`` returns no mask at once (the op masks per sequence), and skips
    its search of the position ids for packed sequences, which reads the device (a sync
    in every eager step)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_hf_attention)
    return NAME
