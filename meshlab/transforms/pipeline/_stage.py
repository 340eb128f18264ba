"""Pipeline stages of an unmodified Hugging Face decoder, on torch.distributed.pipelining.

A stage is the model itself with the blocks of other stages removed, run by a small
module that calls the model's own parts in the order the model's ``forward`` does (the
``base_model_pp_plan`` Hugging Face configs carry: embed_tokens -> layers -> norm, then
the LM head). Parameter names stay those of the model, so checkpoints and plans line up.
"""

from __future__ import annotations

import torch
from torch import nn

from ...core.errors import ConfigError
from .._head import fused_loss_of
from ._guard import stand_in


def _no_cache_kwargs() -> dict:
    """transformers renamed create_causal_mask's cache argument (past_key_values -> cache)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    return {"cache": None} if "cache" in params else {"past_key_values": None}


try:
    _NO_CACHE = _no_cache_kwargs()
except ImportError:  # pragma: no cover - transformers without masking_utils
    _NO_CACHE = {}


class DecoderStage(nn.Module):
    """Runs blocks ``layer_ids`` of ``model`` (plus the embeddings on the first stage and
    the final norm and head on the last)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool,
                 failures=None, seq_split: int = 1):
        super().__init__()
        base = getattr(model, model.base_model_prefix)
        for need in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(base, need):
                raise ConfigError(
                    f"pipeline: {type(model).__name__} lacks {need!r}; meshlab pipelines "
                    f"decoders laid out as embed_tokens -> layers -> norm (the "
                    f"base_model_pp_plan of Llama-like families)")
        # Only this stage's parts are registered: the schedule scales and zeroes the
        # gradients of a stage's own parameters, and a rank may run several stages.
        self._model = (model,)                       # a tuple: not registered
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in layer_ids})
        self.embed = base.embed_tokens if first else None
        self.norm = base.norm if last else None
        self.head = model.lm_head if last else None
        self.layer_ids, self.first, self.last = list(layer_ids), first, last
        self.failures = failures        # ``_guard.StageFailures``: where an exception goes
        # how many parts the sequence is cut into between the blocks (sequence parallelism:
        # the first block cuts it, the last joins it): a later stage receives one part
        self.seq_split = seq_split

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's blocks on ``x``, with the microbatch's ``attention_mask`` and
        ``position_ids`` where the batch has them (the schedule hands every stage its
        microbatch's slice of them by name); under a schedule, an exception is recorded
        and a stand-in handed on, so the other stages do not wait for this one
        (``_guard``)."""
        if self.failures is None:
            return self._blocks(x, attention_mask, position_ids)
        try:
            return self._blocks(x, attention_mask, position_ids)
        except Exception as e:     # raised on every rank once the schedule is done
            self.failures.record(e)
            config = getattr(self._model[0], "config", None)
            dtype = self.embed.weight.dtype if self.first else x.dtype
            out = stand_in(x, getattr(config, "hidden_size", 0), dtype)
            self.failures.stand_ins.add(id(out))
            return out

    def _blocks(self, x: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        model = self._model[0]
        base = getattr(model, model.base_model_prefix)
        h = self.embed(x) if self.first else x                   # (B, S, H)
        # A later stage under sequence parallelism holds 1/seq_split of the sequence; the
        # positions, rotary tables and mask are the whole sequence's, as the model's own
        # forward makes them before its first block (whose hooks cut them as they cut h).
        whole = h if self.first or self.seq_split == 1 else \
            h.new_empty(()).expand(h.shape[0], h.shape[1] * self.seq_split, h.shape[2])
        # The mask and positions the model's forward builds before its first block, from
        # the microbatch's attention_mask and position_ids (a padded row's mask, packed
        # samples' block-diagonal mask), on every stage alike. Without position ids none
        # go to the mask: they are 0..S-1, never packed sequences, and given, transformers
        # reads them back to look for packing (a host round trip per stage and microbatch).
        pos = position_ids if position_ids is not None else \
            torch.arange(whole.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=base.config, inputs_embeds=whole,
                                  attention_mask=attention_mask, position_ids=position_ids,
                                  **_NO_CACHE)
        pe = base.rotary_emb(h, pos)
        for i in self.layer_ids:
            out = self.layers[str(i)](h, attention_mask=mask, position_ids=pos,
                                      position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            h = self.norm(h)
            # a fused loss (fuse('loss')) takes the hidden states and the head together:
            # the schedule's loss runs the head (``runs_head``), the logits never exist
            if not fused_loss_of(model):
                h = self.head(h)                                # (B, S, V)
        return h


def seq_split(plan) -> int:
    """How many parts the sequence is cut into between the blocks: the mesh axes on the
    sequence dimension of the blocks' outputs (Megatron sequence parallelism inside
    ``shard``), times the axis of ``sequence('all_to_all')`` or ``sequence('ring')``."""
    import math

    from ...planning.roles import block_sequence_axes
    from ..sequence import Sequence

    sizes = plan.mesh_shape
    n = math.prod(sizes[a] for a in block_sequence_axes(plan))
    s = plan.get(Sequence)
    if s is not None and s.mode != "split_gather":
        n *= sizes.get(s.axis, 1)
    return n


def prune(model: nn.Module, blocks_kept: set[str]) -> None:
    """Drop the blocks of other stages (their parameters are freed)."""
    base = getattr(model, model.base_model_prefix)
    prefix = model.base_model_prefix + ".layers."
    for i in range(len(base.layers)):
        if f"{prefix}{i}" not in blocks_kept:
            base.layers[i] = nn.Module()


NEEDS = ("embed_tokens", "layers", "norm", "rotary_emb")


def check_layout(plan) -> None:
    """The stages run decoders laid out as ``embed_tokens -> layers -> norm`` (with the
    model's ``rotary_emb``), the base_model_pp_plan of Llama-like families; refuse others
    at plan time, as ``DecoderStage`` would at install."""
    prefix = plan.model.base_prefix
    names = {m.fqn for m in plan.model.modules}
    missing = [n for n in NEEDS if (f"{prefix}.{n}" if prefix else n) not in names]
    if not missing:
        return
    cls = plan.model.cls or "the model"
    tops = {n.split(".")[-1] for n in names if n.count(".") <= (1 if prefix else 0)}
    if {"encoder", "decoder"} <= tops:
        raise ConfigError(f"pipeline: {cls} is an encoder-decoder model; meshlab pipelines "
                          f"decoder-only models (embed_tokens -> layers -> norm) and does not "
                          f"yet split an encoder and a decoder into stages; use zero_shard, "
                          f"shard or remat for it")
    lists = [m.fqn for m in plan.model.modules if m.cls in ("ModuleList", "ModuleDict")]
    raise ConfigError(f"pipeline: {cls} lacks {missing} under {prefix or 'the model'!r}; meshlab "
                      f"pipelines decoders laid out as embed_tokens -> layers -> norm (the "
                      f"base_model_pp_plan of Llama-like families) on its own stages; for "
                      f"any other model, declare its blocks and let its forward skip what a "
                      f"stage does not hold: pipeline(..., blocks={(lists or ['layers'])[0]!r}) "
                      f"(docs/transforms.md, pipeline)")


def check_untied(plan, stages) -> None:
    first = {s.index for s in stages if s.first}
    last = {s.index for s in stages if s.last}
    if first != last and any(e.tied_to for e in plan.params):
        tied = [f"{e.fqn} -> {e.tied_to}" for e in plan.params if e.tied_to]
        raise ConfigError(f"pipeline: tied weights across the first and last stage ({tied}) "
                          f"are not supported; build the model with tie_word_embeddings=False")
