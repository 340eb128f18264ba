"""Saved activations in host memory between a block's forward and its backward, as
``remat(..., offload=k)`` installs it for ``k`` of the blocks it does not checkpoint.

A checkpointed block pays for its memory with a third of its work again; an offloaded one
pays with two copies over the host link, which run on a stream of their own beside the
compute. Each tensor an offloaded block's forward saves for its backward (through
``torch.autograd.graph.saved_tensors_hooks``) is copied into pinned host memory as it is
saved, and its device memory is released once the copy is done (``record_stream``). The
copies come back ahead of need: when the backward reaches the output of the block
``lead`` (``LEAD``) blocks later in the forward (a hook on that output's gradient), so the transfer
runs while those blocks' backward computes; a tensor asked for before then is fetched on
the spot. What is kept on the device: parameters (and views of them), tensors under
``min_bytes`` (on CUDA), subclasses (DTensors) and tensors whose memory is not one dense block.

The values are the saved tensors' own (a copy there and back, bit for bit), so an
offloaded block computes what it would have. On a device without streams (the CPU) the
copies are plain copies in host memory: the same bookkeeping, nothing moved.
"""

from __future__ import annotations

import functools

import optree
import torch
from torch import Tensor


LEAD = 3    # blocks of backward between a block's fetch and its own backward


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory (any order of dimensions): a copy
    with the same strides is then one contiguous transfer."""
    expect = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


class _Held:
    """One saved tensor in host memory; ``dev`` is its copy back, once fetched, and
    ``ready`` the event the compute stream waits on before reading it."""

    __slots__ = ("host", "dev", "ready", "device", "__weakref__")

    def __init__(self, host: Tensor, device: torch.device):
        self.host, self.dev, self.ready, self.device = host, None, None, device


class HostActivations:
    """The offloaded blocks of one model: the pack and unpack hooks of their forwards, and
    the prefetch each schedules on a later block's output."""

    def __init__(self, blocks: int, offloaded: set, lead: int = LEAD, min_bytes: int = 1 << 20):
        self.offloaded = set(offloaded)         # indices into blocks
        self.last = blocks - 1
        self.lead, self.min_bytes = lead, min_bytes
        self.pending: dict[int, list[_Held]] = {}   # block index -> its copies, until hooked
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._seen: dict[int, tuple] = {}
        self._keep: set[int] = set()
        self._into: list | None = None
        self.moved = 0          # bytes copied out, since the model was parallelized
        self.late = 0           # copies fetched when asked for, not ahead

    def trigger(self, j: int) -> int:
        """The block whose output's gradient fetches block ``j``'s copies."""
        return min(j + self.lead, self.last)

    # -- the forward ----------------------------------------------------------------------
    def wrap(self, index: int, module, forward):
        """``forward`` of the block at ``index``: packed into host memory when offloaded,
        and hooking the fetch of the blocks it triggers on its output."""

        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            if index in self.offloaded:
                self.pending[index] = self._into = []
                self._keep = {p.untyped_storage().data_ptr()
                              for p in (*module.parameters(), *module.buffers())}
                try:
                    with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                        out = forward(*args, **kwargs)
                finally:
                    self._into, self._seen, self._keep = None, {}, set()
            else:
                out = forward(*args, **kwargs)
            due = [j for j in list(self.pending) if self.trigger(j) == index]
            if due:
                self._hook(out, [h for j in due for h in self.pending.pop(j)])
            return out

        return run

    def _hook(self, out, helds: list) -> None:
        leaf = next((t for t in optree.tree_leaves(out, none_is_leaf=True)
                     if isinstance(t, Tensor) and t.requires_grad), None)
        if leaf is None or not helds:
            return          # no backward reaches here: each copy is fetched when asked for

        def fetch_ahead(grad):
            for h in helds:
                self._fetch(h)
            helds.clear()   # the saved variables alone hold the copies from here
            return None

        leaf.register_hook(fetch_ahead)

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, t: Tensor):
        stream = self._stream(t.device)
        if type(t) is not Tensor or t.untyped_storage().data_ptr() in self._keep or \
                (stream is not None and t.numel() * t.element_size() < self.min_bytes) or \
                not _dense(t):
            return t.detach()
        seen = self._seen.get(id(t))
        if seen is not None and seen[0] is t:
            return seen[1]
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu",
                                   pin_memory=stream is not None)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(stream)     # the device memory waits for the copy, not longer
        else:
            host.copy_(t.detach())
        held = _Held(host, t.device)
        self._seen[id(t)] = (t, held)
        self._into.append(held)
        self.moved += host.numel() * host.element_size()
        return held

    def _fetch(self, h: _Held) -> None:
        if h.dev is not None:
            return
        stream = self._stream(h.device)
        if stream is None:
            h.dev = h.host.to(h.device, copy=True)
            return
        # allocated in the compute stream's order; the copy waits for that point
        dev = torch.empty_strided(h.host.size(), h.host.stride(), dtype=h.host.dtype,
                                  device=h.device)
        stream.wait_stream(torch.cuda.current_stream(h.device))
        with torch.cuda.stream(stream):
            dev.copy_(h.host, non_blocking=True)
            h.ready = torch.cuda.Event()
            h.ready.record(stream)
        h.dev = dev

    def _unpack(self, x):
        if isinstance(x, Tensor):
            return x
        if x.dev is None:
            self.late += 1
        self._fetch(x)
        if x.ready is not None:
            torch.cuda.current_stream(x.device).wait_event(x.ready)
            x.ready = None
        return x.dev
