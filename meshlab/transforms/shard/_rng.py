"""The random streams of dropout under tensor parallelism (Megatron's two RNG states).

In a sharded region (from a region's entry, or a column-parallel output, to the input of
the row-parallel projection that closes it) each rank holds other features: its own
attention heads, its slice of the MLP. Drawn from one stream, the dropout mask of local
head ``i`` would be the same on every tp rank, so heads ``i`` and ``i + H/tp`` would share
a mask, where one process draws every head's independently. Outside the regions every tp
rank holds the same activations, and their masks must agree, or the replicas of one
activation would differ.

So the device's default generator stays the stream of the replicated regions (the same on
every tp rank: seed every rank alike, as with one process), and each sharded region draws
from a stream of its own rank: on entry, a key is taken from the shared state (which then
advances by one draw on every tp rank alike) and the generator is seeded from the key and
the tp rank; on exit the shared state comes back. Every mask element is then an
independent Bernoulli draw, equal in distribution to one process's; replicated masks stay
equal across the tp ranks. The key comes from the shared state, so recomputation under
activation checkpointing (which restores that state) draws the same masks again.

Under Megatron sequence parallelism the activations between the regions are split over
the sequence too: the whole span from the first block's split to the last block's gather
is sharded, and draws from the rank's stream.

A model that drops nothing (no dropout module with p > 0, no dropout probability above 0
in its config: most decoders' defaults) gets no switches: they would cost a graph break
in each region of a compiled block and change no draw.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ._styles import ColWise, RowWise


def _generator(device_type: str) -> torch.Generator:
    """The default generator dropout draws from on this rank's device."""
    if device_type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device()]
    return torch.default_generator


class TPRng:
    """This rank's stream for sharded regions, forked from the shared one."""

    def __init__(self, rank: int, device_type: str) -> None:
        self.rank, self.device_type = rank, device_type
        self.saved: torch.Tensor | None = None      # the shared state while forked

    def enter(self) -> None:
        """From here on, draws come from this rank's stream (idempotent)."""
        if self.saved is not None:
            return
        g = _generator(self.device_type)
        state = g.get_state()
        key = hashlib.blake2b(state.numpy().tobytes() + self.rank.to_bytes(4, "little"),
                              digest_size=8).digest()
        # the shared stream moves on by one draw on every tp rank alike, so the next
        # region (or step) gets another key
        torch.empty(1, device=self.device_type).uniform_(generator=g)
        self.saved = g.get_state()
        g.manual_seed(int.from_bytes(key, "little") & ((1 << 63) - 1))

    def leave(self) -> None:
        """Back to the shared stream (idempotent)."""
        if self.saved is None:
            return
        _generator(self.device_type).set_state(self.saved)
        self.saved = None


def drops(model: nn.Module) -> bool:
    """Whether ``model`` may draw dropout masks: a dropout module with ``p > 0``, or a
    probability above 0 in its config (``attention_dropout``, ``attn_pdrop``, ...), which
    the functional dropout of an attention implementation reads."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    cfg = getattr(model, "config", None)
    items = cfg.to_dict().items() if hasattr(cfg, "to_dict") else ()
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0
               for k, v in items)


def install(model: nn.Module, layout, tp) -> TPRng | None:
    """Hook the stream switches into ``model`` by the TP layout (see the module doc); none
    for a model that drops nothing."""
    if not drops(model):
        return None
    rng = TPRng(tp.rank, tp.mesh.device_type)
    mods = dict(model.named_modules())
    enter = lambda *_: rng.enter()
    leave = lambda *_: rng.leave()
    # a forward that raised inside a region left the stream forked: back to the shared
    model.register_forward_pre_hook(leave, prepend=True)
    if tp.sp and layout.first_block is not None:
        mods[layout.first_block].register_forward_pre_hook(enter)
        mods[layout.last_block].register_forward_hook(leave, always_call=True)
        return rng
    for fqn in layout.regions:
        mods[fqn].register_forward_pre_hook(enter)
        mods[fqn].register_forward_hook(leave, always_call=True)
    for spec in layout.modules:
        if isinstance(spec.style, ColWise) and not spec.style.gather_output:
            mods[spec.fqn].register_forward_hook(enter)       # its output is split
        elif isinstance(spec.style, RowWise):
            mods[spec.fqn].register_forward_pre_hook(leave)   # its output is whole
    return rng
