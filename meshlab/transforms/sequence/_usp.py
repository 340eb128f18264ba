"""Two-dimensional sequence parallelism: Ulysses over one mesh axis, ring attention over
another (``sequence(a, 'all_to_all') | sequence(r, 'ring')``, the layout of "unified
sequence parallelism").

Between the blocks a rank holds S/(a r) of the sequence: the ring's zigzag cut over r
first (chunks j and 2r-1-j of ring rank j), then a contiguous cut of that part over a.
In attention the Ulysses all-to-all over a trades the sequence for heads, so each rank
holds H/a heads of its ring rank's zigzag part (its a pieces joined in order), exactly
what ring attention over r takes; the ring's output goes back through the all-to-all.
K and V cross the all-to-all with their own heads where those divide over a (else
expanded to the query heads) and travel the ring with them. Padded and packed batches:
the model's mask of the whole sequence is read as causal segments, as ring attention
alone reads it. Gradients of the blocks' parameters are summed over both axes (each
room declares its own reduction).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ...core import collectives as C
from ...core.errors import SpecError
from .._seqsplit import install_split
from . import _ring
from ._ulysses import _AllToAll, register_mask, set_attention

NAME = "meshlab_ulysses_ring"


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """(B, H, S/(a r), D) per rank -> H/a heads of the ring part (all-to-all over a) ->
    ring attention over r -> back; returned as (B, S/(a r), H, D)."""
    heads_group, ring_group = module._meshlab_usp_groups
    a = dist.get_world_size(heads_group)
    query, key, value = _ring._one_dtype(query, key, value)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and key.shape[1] % a:              # K/V heads do not divide: one per q head
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q, k, v = (_AllToAll.apply(t, heads_group, 1, 2) for t in (query, key, value))
    out = _ring.over_ring(q, k, v, attention_mask, scaling, dropout, ring_group)
    out = _AllToAll.apply(out, heads_group, 2, 1)    # (B, H, S/(a r), D)
    return out.transpose(1, 2).contiguous(), None


def install(model: nn.Module, blocks: tuple[str, ...], heads_group, ring_group,
            held: frozenset) -> None:
    """Attention over both groups in the ``held`` blocks (this rank's, of the model's
    ``blocks``); the sequence cut before the first block (zigzag over the ring, then
    contiguous over the heads' axis) and joined after the last, in the other order."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    register_mask(NAME)
    set_attention(model, NAME)
    mods = dict(model.named_modules())
    for b in blocks:
        if b in held:
            for m in mods[b].modules():
                m._meshlab_usp_groups = (heads_group, ring_group)
    a, r = dist.get_world_size(heads_group), dist.get_world_size(ring_group)

    def split(h):
        unit = r * math.lcm(2, a)
        if h.shape[1] % unit:
            raise SpecError(f"sequence(all_to_all) x sequence(ring): sequence length "
                            f"{h.shape[1]} does not divide into 2 zigzag chunks per ring rank "
                            f"({r}), each ring part over {a} ranks; pad it to a multiple of "
                            f"{unit}")
        return C.split_seq(_ring._zigzag_split(h, ring_group), heads_group, 1)

    def gather(h):
        return _ring._zigzag_gather(C.gather_seq_replicated(h, heads_group, 1), ring_group)

    install_split(model, blocks, split, gather, held)
