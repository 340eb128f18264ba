"""How a batch lays its samples out in rows, read the way transformers reads it: padding
(``attention_mask`` 0 on tokens no sample holds) and packing (``position_ids`` that start
again inside a row: a position that does not follow the one before it starts a sample).

transformers builds the block-diagonal causal mask of packed samples from
``position_ids`` only where the forward gets no 2-D ``attention_mask`` and builds no
cache (``masking_utils.find_packed_sequence_indices``); given a mask, or a training forward
left with its default ``use_cache=True``, it masks the padding and lets the packed samples
attend to each other. :func:`as_packed` gives such a batch the form transformers reads
exactly: the padding folded into the position ids (each masked token a sample of its own,
which no other token attends to), no ``attention_mask``, ``use_cache=False``.
:func:`layout_of` says whether a batch is padded or packed, for the rooms whose attention
reads neither (``check_batch``)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch import Tensor

from ..core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Layout:
    """``padded``: some row's ``attention_mask`` holds a 0. ``packed``: some row holds
    more than one sample (its ``position_ids`` start again among the tokens it attends)."""

    padded: bool = False
    packed: bool = False

    def describe(self) -> str:
        """What the batch does, in words, for a refusal."""
        parts = (["pads its rows (attention_mask holds 0)"] if self.padded else []) + \
            (["packs several samples in a row (position_ids start again inside it)"]
             if self.packed else [])
        return " and ".join(parts)

    def __bool__(self) -> bool:
        return self.padded or self.packed


def _mask(batch: Mapping) -> Tensor | None:
    m = batch.get("attention_mask")
    return m if isinstance(m, Tensor) and m.dim() == 2 else None


def _positions(batch: Mapping, shape) -> Tensor | None:
    p = batch.get("position_ids")
    if not isinstance(p, Tensor) or p.dim() != 2 or p.shape[-1] != shape[-1]:
        return None
    return p.expand(shape) if p.shape[0] == 1 else p


def _shape(batch: Mapping):
    for key in ("input_ids", "attention_mask", "position_ids"):
        t = batch.get(key)
        if isinstance(t, Tensor) and t.dim() == 2:
            return t.shape
    return None


def _starts(pos: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """Per token: whether it is the first attended token of a sample, and whether it goes
    on a sample across masked tokens (a masked token between two attended tokens of one
    sample). Samples are transformers' (``find_packed_sequence_indices``): a position
    that does not follow the one before it in the row starts one."""
    b, s = pos.shape
    diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    sample = (diff != 1).cumsum(-1)
    idx = torch.arange(s, device=pos.device).expand(b, s)
    last = torch.where(real, idx, -1).cummax(1).values            # last attended <= i
    prev = torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1)  # ... < i
    same = (prev >= 0) & (sample.gather(1, prev.clamp(min=0)) == sample)
    return real & ~same, real & same & (prev != idx - 1)


def layout_of(batch) -> Layout:
    """The layout of a dict batch (a tensor batch is neither padded nor packed). A row is
    packed where its attended tokens belong to more than one sample."""
    if not isinstance(batch, Mapping):
        return Layout()
    shape = _shape(batch)
    if shape is None:
        return Layout()
    mask = _mask(batch)
    pos = _positions(batch, shape)
    padded = mask is not None and not bool((mask != 0).all())
    packed = False
    if pos is not None:
        real = torch.ones(shape, dtype=torch.bool, device=pos.device) if mask is None else \
            (mask != 0).to(pos.device)
        starts, _ = _starts(pos, real)
        packed = bool((starts.sum(1) > 1).any())
    return Layout(padded, packed)


def as_packed(batch: Mapping, takes) -> Mapping:
    """``batch`` in the form transformers masks exactly, for a forward whose keyword
    parameters ``takes`` include ``position_ids`` and ``use_cache`` (a Hugging Face
    model's): where the batch has ``position_ids``, the forward builds no cache
    (``use_cache=False``, unless the batch says); where a row also holds several samples,
    a 2-D ``attention_mask`` is folded into the position ids and dropped (a batch of one
    sample a row keeps its mask, which transformers reads). Every attended token keeps its
    position; a masked token takes the position of the next attended token of its row (0
    after the last), so it starts a sample of its own, which no other token attends to,
    and the next attended token starts another. A packed batch that masks tokens inside a
    sample (positions that go on across them) is refused with ``ConfigError``: position
    ids cannot express it, and transformers reads packing from them only without a mask."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("position_ids"), Tensor) \
            or not {"position_ids", "use_cache"} <= set(takes):
        return batch
    out = dict(batch)
    out.setdefault("use_cache", False)
    shape = _shape(batch)
    mask = _mask(batch)
    pos = _positions(batch, shape) if shape is not None else None
    if mask is None or pos is None:
        return out
    real = (mask != 0).to(pos.device)
    starts, holes = _starts(pos, real)
    if not bool((starts.sum(1) > 1).any()):
        return out                       # one sample a row: transformers reads the mask
    first = _first(holes)
    if first is not None:
        row, col = first
        raise ConfigError(
            f"step: a row of the batch (row {row} of this microbatch) packs samples "
            f"(position_ids start again inside it) and masks tokens inside one of them "
            f"(attention_mask 0 before column {col}, whose sample goes on across the masked "
            f"tokens: each position follows the one before it). transformers masks packed "
            f"samples by their position ids alone and cannot leave tokens out inside one; "
            f"drop those tokens from the sample, or put the padding between samples or at "
            f"the ends of the row")
    s = shape[-1]
    idx = torch.arange(s, device=pos.device).expand(shape)
    nxt = torch.where(real, idx, s).flip(1).cummin(1).values.flip(1)  # next attended >= i
    pad_pos = torch.where(nxt < s, pos.gather(1, nxt.clamp(max=s - 1)), 0)
    out["position_ids"] = torch.where(real, pos, pad_pos)
    del out["attention_mask"]
    return out


def _first(flags: Tensor) -> tuple[int, int] | None:
    """(row, column) of the first True of a 2-d bool tensor, or None."""
    if not bool(flags.any()):
        return None
    row, col = (int(v) for v in flags.nonzero()[0])
    return row, col


SEGMENTS_WHY = ("meshlab's attention over segments (a padding token attends to itself "
                "alone) does not compute as transformers' attention does")


def check_labels_after_padding(batch: Mapping, layout: Layout, what: str, fix: str,
                               why: str = SEGMENTS_WHY) -> None:
    """Refuse a padded batch whose loss would read a padding token's output: a label other
    than -100 right after a token with ``attention_mask`` 0. meshlab's attention over
    causal segments (``ops._attention_hf.causal_segments``: each padding token a segment of
    its own) computes every other token exactly as transformers masks it, but a padding
    token sees itself alone, where transformers' masked row sees otherwise; no sample run
    alone has such a label either. ``what`` names the room, ``fix`` its way out, ``why``
    why the room's padding outputs differ."""
    if not layout.padded:
        return
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    if not isinstance(mask, Tensor) or not isinstance(labels, Tensor) or \
            mask.dim() != 2 or tuple(labels.shape) != tuple(mask.shape):
        return
    first = _first((mask[:, :-1] == 0) & (labels[:, 1:].to(mask.device) != -100))
    if first is not None:
        row, col = first
        raise ConfigError(
            f"{what}: row {row} of this batch labels column {col + 1} (not -100) after a "
            f"padding token (attention_mask 0 at column {col}), so the loss reads that "
            f"padding token's output, which {why}. Label the token after padding -100 (a "
            f"sample run alone has no token before its first), or {fix}")
