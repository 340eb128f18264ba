"""What a pipelined step hands the schedule: the first stage's input, the keyword inputs
every stage's forward takes, and the microbatches the loss reads on the last stage.

The batch is matched to the forward the stages run as ``meshlab.step`` matches it to a
model's forward. For a model with declared blocks (``_blocks``), the key named like the
forward's first parameter is the first stage's input (the later stages receive the
hidden states in its place); every other key the forward takes (``attention_mask``,
``position_ids``, ...) goes to every stage by name, cut into microbatches by torch's
schedule (its default chunk spec: tensors along dim 0, other values repeated), and
``labels`` goes to the loss only. meshlab's stages of a Hugging Face decoder read
``input_ids`` (``_runtime._pipeline_batch``) on the first stage and ``attention_mask`` and
``position_ids`` on every stage (``decoder_feed``). Either way the loss is the caller's,
``loss_fn(output, microbatch)``, with the microbatch cut from the whole batch, every key
in it: the schedule hands the last stage the chunk of ``index`` (``arange(m)``) for each
microbatch, a view whose storage offset is that microbatch's number, read without a
transfer from the device.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

import torch

from ...core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Signature:
    """The parameters of the forward a model's stages run, as batch keys are matched."""

    cls: str
    first: str                # its first parameter: the first stage's input
    names: frozenset          # the parameters it takes by name
    var_kw: bool              # whether it takes ``**kwargs``


def signature_of(model) -> Signature:
    """``type(model).forward``'s parameters (the forward every stage runs)."""
    cls = type(model).__name__
    params = list(inspect.signature(type(model).forward).parameters.values())[1:]   # self
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise ConfigError(f"pipeline: {cls}.forward takes no positional parameter; a stage "
                          f"receives the previous stage's hidden states as the first "
                          f"positional argument, so write forward(self, x, ...)")
    return Signature(cls, positional[0].name, frozenset(p.name for p in named),
                     any(p.kind is p.VAR_KEYWORD for p in params))


@dataclasses.dataclass
class Feed:
    """One schedule call's inputs: ``args`` for the first stage, ``kwargs`` for every
    stage (whole batch; the schedule cuts both), ``mbs`` the loss's microbatches,
    ``index`` the schedule's target (``arange(m)``) and ``batch`` what the ranks that
    read it together agree on."""

    args: tuple
    kwargs: dict
    mbs: list
    index: torch.Tensor
    batch: Any


def _rows(batch, m: int) -> list:
    """``batch`` cut into ``m`` microbatches along dim 0 (every tensor of a dict; other
    values repeated), as ``meshlab.step`` and torch's schedule cut it."""
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(m))
    parts = {k: list(v.chunk(m)) if isinstance(v, torch.Tensor) else [v] * m
             for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(m)]


def _check_rows(batch, m: int) -> None:
    """Every tensor of ``batch`` has the same rows along dim 0, a multiple of ``m`` (the
    schedule cuts them alike): refused before the first send otherwise, on every rank
    alike (the shapes were agreed)."""
    items = batch.items() if isinstance(batch, Mapping) else [("batch", batch)]
    tensors = [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
    for k, v in tensors:
        if v.dim() == 0:
            raise ConfigError(f"step: a pipelined model's batch[{k!r}] is a scalar tensor; "
                              f"the schedule cuts every tensor of the batch along dim 0 "
                              f"into microbatches")
    rows = {k: v.shape[0] for k, v in tensors}
    n = next(iter(rows.values()), 0)
    if any(r != n for r in rows.values()) or n == 0 or n % m:
        raise ConfigError(
            f"step: pipeline(microbatches={m}) cuts every tensor of the local batch along "
            f"dim 0 into {m} equal microbatches, but the batch has rows {rows}; give every "
            f"tensor the same number of rows, a multiple of {m} per data-parallel rank")


def own_feed(batch, m: int, sig: Signature) -> Feed:
    """The inputs of a model with declared blocks (module docstring)."""
    _check_rows(batch, m)
    index = torch.arange(m)
    if not isinstance(batch, Mapping):
        return Feed((batch,), {}, _rows(batch, m), index, batch)
    if sig.first not in batch:
        raise ConfigError(f"step: a pipeline's first stage reads the batch key named as "
                          f"{sig.cls}.forward's first parameter, {sig.first!r}; this batch "
                          f"has {sorted(map(str, batch))}. Name that key {sig.first!r}")
    kwargs = {k: v for k, v in batch.items() if k not in (sig.first, "labels")}
    unknown = [k for k in kwargs if k not in sig.names and not sig.var_kw]
    if unknown:
        raise ConfigError(f"step: the batch has keys {sorted(map(str, batch))}, but "
                          f"{sig.cls}.forward takes {sorted(sig.names)}; key(s) {unknown} "
                          f"have no parameter (labels go to the loss only). Drop them, or "
                          f"give the forward a parameter of that name")
    return Feed((batch[sig.first],), kwargs, _rows(batch, m), index, batch)


DECODER_KEYS = ("attention_mask", "position_ids")   # what every decoder stage reads by name


def decoder_feed(batch, m: int, x: torch.Tensor, ids: bool = False) -> Feed:
    """The inputs of meshlab's stages of a Hugging Face decoder: ``x`` (the input ids,
    ``_pipeline_batch`` checked the batch) for the first stage; the batch's
    ``attention_mask`` and ``position_ids`` to every stage by name, in the form
    ``meshlab.step`` gives a Hugging Face model (``_packing.as_packed``: where rows pack
    several samples, the mask folded into the position ids), so each stage builds the
    mask and positions the model's forward builds for its microbatch; the loss reads the
    microbatches of the whole batch (of ``{'input_ids': x}`` for a tensor). With ``ids``
    (a sequence classifier) the input ids go to every stage by name too: the last pools
    each row at its last token that is not padding."""
    from .._packing import as_packed

    whole = dict(batch) if isinstance(batch, Mapping) else {"input_ids": x}
    _check_rows(whole, m)
    packed = as_packed(whole, ("position_ids", "use_cache"))
    kwargs = {k: packed[k] for k in DECODER_KEYS if packed.get(k) is not None}
    if ids:
        kwargs["input_ids"] = x
    return Feed((x,), kwargs, _rows(whole, m), torch.arange(m), whole)


def microbatch(feed: Feed, index: torch.Tensor):
    """The microbatch whose chunk of ``feed.index`` the schedule handed the loss."""
    return feed.mbs[index.storage_offset()]
