"""Pipeline stages of an unmodified Hugging Face decoder, on torch.distributed.pipelining.

A stage is the model itself with the blocks of other stages removed, run by a small
module that calls the model's own parts in the order the model's ``forward`` does. Where
those parts are is data (``LAYOUTS``): Llama-like families keep them as their
``base_model_pp_plan`` says (embed_tokens -> layers -> norm, a rotary table handed to
every block), GPT-2-like ones as wte + wpe -> h -> ln_f (learned positions added to the
tokens' embeddings, dropout on the sum); then the LM head. Parameter names stay those of
the model, so checkpoints and plans line up.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import nn

from ...core.errors import ConfigError
from .._head import LOGIT_TRANSFORMS, elsewhere, fused_loss_of, set_extras
from ._guard import stand_in

log = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a decoder's forward finds its parts, under its base model (``base_model_prefix``):
    the token embedding, the blocks (a ModuleList), the final norm; a rotary table every
    block is handed (Llama-like), or learned positions added to the tokens' embeddings and a
    dropout on the sum (GPT-2-like)."""

    name: str
    embed: str
    layers: str
    norm: str
    rotary: str | None = None
    positions: str | None = None
    dropout: str | None = None
    block_kwargs: tuple = ()      # what the model's forward also hands every block

    @property
    def needs(self) -> tuple[str, ...]:
        return tuple(n for n in (self.embed, self.layers, self.norm, self.rotary,
                                 self.positions) if n)

    @property
    def first_only(self) -> tuple[str, ...]:
        """The parts with parameters only the first stage runs."""
        return tuple(n for n in (self.embed, self.positions) if n)


LAYOUTS = (
    Layout("embed_tokens -> layers -> norm", "embed_tokens", "layers", "norm",
           rotary="rotary_emb"),
    Layout("wte + wpe -> h -> ln_f", "wte", "h", "ln_f", positions="wpe", dropout="drop"),
    # GPT-J: rotary positions, the embeddings' dropout before the blocks
    Layout("wte -> h -> ln_f", "wte", "h", "ln_f", rotary="rotary_emb", dropout="drop"),
    # Falcon with rotary positions (its ALiBi configs are refused: NOT_STAGED)
    Layout("word_embeddings -> h -> ln_f", "word_embeddings", "h", "ln_f",
           rotary="rotary_emb", block_kwargs=(("alibi", None),)),
)


def head_name(model_or_cls) -> str:
    """The last stage's head: ``lm_head`` (a causal LM), or ``score`` for a sequence
    classifier (``*ForSequenceClassification``: the head on every position, then the row's
    last token that is not padding pooled, as its forward does)."""
    return "score" if pools(model_or_cls) else "lm_head"


def pools(model_or_cls) -> bool:
    """Whether the model is a sequence classifier whose logits are pooled from its last
    token that is not padding."""
    x = model_or_cls
    name = x if isinstance(x, str) else x.__name__ if isinstance(x, type) else type(x).__name__
    return name.endswith("ForSequenceClassification")


def check_pooled_rows(pad_token_id: int | None, rows: int) -> None:
    """A sequence classifier pools each row at its last token that is not padding, which
    a config without a pad id defines for rows of one only (its forward refuses more)."""
    if pad_token_id is None and rows > 1:
        raise ConfigError(f"pipeline: a sequence classifier pools each row's last token that "
                          f"is not padding, and its config names no pad_token_id; set "
                          f"model.config.pad_token_id (e.g. to the tokenizer's eos_token_id), "
                          f"or use microbatches of one row (these have {rows})")


def pool_last_token(logits: torch.Tensor, input_ids: torch.Tensor | None,
                    pad_token_id: int | None) -> torch.Tensor:
    """Each row's logits at its last token that is not ``pad_token_id`` (the last
    position with no pad id), as Hugging Face's sequence classifiers pool them. Without a
    pad id only rows of one are defined; more are refused by name."""
    rows = logits.shape[0]
    check_pooled_rows(pad_token_id, rows)
    if pad_token_id is None:
        return logits[:, -1]
    if input_ids is None:
        raise ConfigError("pipeline: a sequence classifier's last stage pools each row by its "
                          "input_ids, and the schedule handed it none")
    keep = (input_ids != pad_token_id).to(device=logits.device, dtype=torch.int32)
    where = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
    last = (where * keep).argmax(-1)
    return logits[torch.arange(rows, device=logits.device), last]


def layout_of(has) -> Layout | None:
    """The first of ``LAYOUTS`` whose parts ``has(name)`` finds under the base model."""
    return next((lay for lay in LAYOUTS if all(has(n) for n in lay.needs)), None)


def model_layout(model: nn.Module) -> Layout:
    base = getattr(model, model.base_model_prefix)
    lay = layout_of(lambda n: hasattr(base, n))
    if lay is None:
        raise ConfigError(f"pipeline: {type(model).__name__} is laid out as none of "
                          f"{_LAYOUT_NAMES}; meshlab pipelines Hugging Face decoders laid "
                          f"out so")
    return lay


_MASKS = ("full_attention", "sliding_attention")


def layer_masks(config) -> list[str] | None:
    """The mask each block attends under, as the model's own forward builds them: per
    ``config.layer_types`` (Qwen2, Qwen3, Gemma 2: full or sliding-window causal), every
    block sliding where the config names a window without layer types (Mistral, Mixtral,
    Phi-3), else None: every block full causal."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * config.num_hidden_layers
    return None


# Config attributes with which a model's forward does what meshlab's stages do not:
# scales the token embeddings before the first block, adds ALiBi to its masks, or
# transforms the logits after the head (the attribute and the value at which it does
# nothing).
NOT_STAGED = {"embedding_multiplier": 1.0, "embedding_scale": 1.0, "alibi": False,
              **LOGIT_TRANSFORMS}


def stage_probe(model: nn.Module) -> str | None:
    """Whether meshlab's stages compute what ``model``'s own forward does, shown on a tiny
    float64 copy of its config (its size fields shrunk, a sliding window cut to 4 of 8
    positions, a left-padded row): the model's logits against its two stages run in turn.
    None where they agree to 1e-9; else what differs. Once per class and config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        text = config.to_json_string(use_diff=False)
    except (TypeError, ValueError):         # a config that does not serialize: not cached
        return _probe(type(model), config.to_dict())
    return _probe_cached(type(model), text)


@functools.lru_cache(maxsize=64)
def _probe_cached(cls, text: str) -> str | None:
    import json

    return _probe(cls, json.loads(text))


def _probe(cls, values: dict) -> str | None:
    from ...policies.tiny import VOCAB, tiny_config

    try:
        cfg = tiny_config(values["model_type"], base=cls.config_class.from_dict(values))
        if getattr(cfg, "sliding_window", None) is not None:
            cfg.sliding_window = 4
        if hasattr(cfg, "_experts_implementation"):     # float64: the experts' loop
            cfg._experts_implementation = "eager"
        torch.manual_seed(0)
        tiny = cls(cfg).to(torch.float64).eval()
    except Exception as e:      # noqa: BLE001 - TinyConfigError, or the family's own
        log.warning("pipeline: %s could not be checked on a tiny copy (%s: %s); its "
                    "stages run as laid out", cls.__name__, type(e).__name__, e)
        return None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(VOCAB, cfg.vocab_size), (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    if pools(cls):        # a sequence classifier: the second row ends in two pad ids
        if cfg.pad_token_id is None:
            cfg.pad_token_id = tiny.config.pad_token_id = 0
        ids[1, -2:] = cfg.pad_token_id
        mask[1, -2:] = 0
    n = len(getattr(getattr(tiny, tiny.base_model_prefix), model_layout(tiny).layers))
    with torch.no_grad():
        want = tiny(input_ids=ids, attention_mask=mask).logits
        h = DecoderStage(tiny, list(range(n // 2)), True, False)(ids, mask)
        got = DecoderStage(tiny, list(range(n // 2, n)), False, True)(h, mask, input_ids=ids)
    worst = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if worst <= 1e-9 * max(1.0, float(want.abs().max())):
        return None
    return (f"on a tiny float64 copy of its config, its logits and those of meshlab's "
            f"stages differ by {worst:.1e}")


def check_staged(config, cls: str) -> None:
    """Refuse, by name, a decoder whose forward does what the stages would skip: masks of
    another kind than full or sliding-window causal, a scale on the embeddings or a
    transform of the logits (``NOT_STAGED``)."""
    kinds = layer_masks(config) or []
    other = sorted(set(kinds) - set(_MASKS))
    if other:
        raise ConfigError(f"pipeline: {cls} has layers of type {other}, whose masks meshlab's "
                          f"stages do not build (they build {list(_MASKS)}); parallelize it "
                          f"without pipeline()")
    for attr, v in set_extras(config, NOT_STAGED)[:1]:
        raise ConfigError(f"pipeline: {cls}'s forward applies {attr}={v!r} around its "
                          f"blocks and head, which meshlab's stages do not yet apply; "
                          f"parallelize it without pipeline()")


class DecoderStage(nn.Module):
    """Runs blocks ``layer_ids`` of ``model`` (plus the embeddings on the first stage and
    the final norm and head on the last), its parts found by its ``Layout``."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool,
                 failures=None, seq_split: int = 1):
        super().__init__()
        base = getattr(model, model.base_model_prefix)
        lay = self.layout = model_layout(model)
        check_staged(base.config, type(model).__name__)
        # Only this stage's parts are registered: the schedule scales and zeroes the
        # gradients of a stage's own parameters, and a rank may run several stages.
        self._model = (model,)                       # a tuple: not registered
        blocks = getattr(base, lay.layers)
        self.layers = nn.ModuleDict({str(i): blocks[i] for i in layer_ids})
        self.embed = getattr(base, lay.embed) if first else None
        self.positions = getattr(base, lay.positions) if first and lay.positions else None
        self.dropout = getattr(base, lay.dropout, None) if first and lay.dropout else None
        self.norm = getattr(base, lay.norm) if last else None
        self.head = getattr(model, head_name(model)) if last else None
        self.pools = last and pools(model)
        self.layer_ids, self.first, self.last = list(layer_ids), first, last
        self.failures = failures        # ``_guard.StageFailures``: where an exception goes
        # how many parts the sequence is cut into between the blocks (sequence parallelism:
        # the first block cuts it, the last joins it): a later stage receives one part
        self.seq_split = seq_split

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's blocks on ``x``, with the microbatch's ``attention_mask`` and
        ``position_ids`` where the batch has them (the schedule hands every stage its
        microbatch's slice of them by name), and its ``input_ids`` where a sequence
        classifier's last stage pools by them; under a schedule, an exception is recorded
        and a stand-in handed on, so the other stages do not wait for this one
        (``_guard``)."""
        if self.failures is None:
            return self._blocks(x, attention_mask, position_ids, input_ids)
        try:
            return self._blocks(x, attention_mask, position_ids, input_ids)
        except Exception as e:     # raised on every rank once the schedule is done
            self.failures.record(e)
            config = getattr(self._model[0], "config", None)
            dtype = self.embed.weight.dtype if self.first else x.dtype
            out = stand_in(x, getattr(config, "hidden_size", 0), dtype)
            self.failures.stand_ins.add(id(out))
            return out

    def _blocks(self, x: torch.Tensor, attention_mask=None, position_ids=None,
                input_ids=None) -> torch.Tensor:
        from transformers.masking_utils import (create_causal_mask,
                                                create_sliding_window_causal_mask)

        model = self._model[0]
        base = getattr(model, model.base_model_prefix)
        lay = self.layout
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
        if self.positions is not None:                # learned positions (GPT-2)
            h = h + self.positions(pos).to(h.device)
        if self.dropout is not None:
            h = self.dropout(h)
        # what the model's forward hands every block besides the mask and positions
        extra = dict(lay.block_kwargs)
        if lay.rotary:
            extra["position_embeddings"] = getattr(base, lay.rotary)(h, pos)
        else:
            extra["use_cache"] = False
        kinds = layer_masks(base.config)
        masks: dict = {}            # each kind of mask built once, as the block needs it
        for i in self.layer_ids:
            kind = kinds[i] if kinds is not None else "full_attention"
            if kind not in masks:
                make = create_causal_mask if kind == "full_attention" else \
                    create_sliding_window_causal_mask
                masks[kind] = make(config=base.config, inputs_embeds=whole,
                                   attention_mask=attention_mask, position_ids=position_ids,
                                   **_NO_CACHE)
            out = self.layers[str(i)](h, attention_mask=masks[kind], position_ids=pos, **extra)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            h = self.norm(h)
            # a fused loss (fuse('loss')) takes the hidden states and the head together:
            # the schedule's loss runs the head (``runs_head``), the logits never exist
            if not fused_loss_of(model):
                h = self.head(h)                                # (B, S, V)
            if self.pools:                                      # (B, labels)
                h = pool_last_token(h, input_ids, base.config.pad_token_id)
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
    lay = model_layout(model)
    blocks = getattr(getattr(model, model.base_model_prefix), lay.layers)
    prefix = f"{model.base_model_prefix}.{lay.layers}."
    for i in range(len(blocks)):
        if f"{prefix}{i}" not in blocks_kept:
            blocks[i] = elsewhere()


_LAYOUT_NAMES = " or ".join(lay.name for lay in LAYOUTS)


def check_layout(plan) -> None:
    """The stages run decoders laid out as one of ``LAYOUTS`` (embed_tokens -> layers ->
    norm with the model's ``rotary_emb``, the base_model_pp_plan of Llama-like families;
    wte + wpe -> h -> ln_f, GPT-2's); refuse others at plan time, as ``DecoderStage``
    would at install."""
    prefix = plan.model.base_prefix
    names = {m.fqn for m in plan.model.modules}
    if layout_of(lambda n: (f"{prefix}.{n}" if prefix else n) in names) is not None:
        head = head_name(plan.model.cls or "")
        if head not in names:
            raise ConfigError(f"pipeline: {plan.model.cls or 'the model'} has no {head}; "
                              f"meshlab's decoder stages end in a causal-LM head (lm_head) "
                              f"or a sequence classifier's (score, pooled at each row's last "
                              f"token); parallelize it without pipeline()")
        config = getattr(plan.source, "config", None)
        if config is not None:
            check_staged(config, plan.model.cls or "the model")
            why = stage_probe(plan.source)
            if why is not None:
                raise ConfigError(f"pipeline: {plan.model.cls}'s forward does what meshlab's "
                                  f"stages do not: {why}; parallelize it without pipeline()")
        return
    cls = plan.model.cls or "the model"
    tops = {n.split(".")[-1] for n in names if n.count(".") <= (1 if prefix else 0)}
    if {"encoder", "decoder"} <= tops:
        raise ConfigError(f"pipeline: {cls} is an encoder-decoder model; meshlab pipelines "
                          f"decoder-only models ({_LAYOUT_NAMES}) and does not "
                          f"yet split an encoder and a decoder into stages; use zero_shard, "
                          f"shard or remat for it")
    missing = [n for n in LAYOUTS[0].needs
               if (f"{prefix}.{n}" if prefix else n) not in names]
    lists = [m.fqn for m in plan.model.modules if m.cls in ("ModuleList", "ModuleDict")]
    raise ConfigError(f"pipeline: {cls} lacks {missing} under {prefix or 'the model'!r}; meshlab "
                      f"pipelines decoders laid out as {_LAYOUT_NAMES} (Llama-like, GPT-2, "
                      f"GPT-J and Falcon families) on its own stages; for "
                      f"any other model, declare its blocks and let its forward skip what a "
                      f"stage does not hold: pipeline(..., blocks={(lists or ['layers'])[0]!r}) "
                      f"(docs/transforms.md, pipeline)")


def check_untied(plan, stages, declared: bool) -> None:
    """A head tied to the token embeddings (``tie_word_embeddings``) on another rank than
    the first stage trains as one process (``TiedHead``) on meshlab's decoder stages
    beside data parallelism, ZeRO and tensor parallelism. Refused by name: any other tie
    across ranks, ties under declared blocks, and ties beside FSDP by parameter specs."""
    first = {s.rank for s in stages if s.first}
    last = {s.rank for s in stages if s.last}
    tied = [e for e in plan.params if e.tied_to]
    if first == last or not tied:
        return
    pairs = [f"{e.fqn} -> {e.tied_to}" for e in tied]
    if declared:
        raise ConfigError(f"pipeline(blocks=...): tied weights across the first and last "
                          f"stage ({pairs}) are not supported on declared blocks; build the "
                          f"model with tie_word_embeddings=False")
    prefix = plan.model.base_prefix
    embeds = {f"{prefix}.{lay.embed}.weight" if prefix else f"{lay.embed}.weight"
              for lay in LAYOUTS}
    other = [p for e, p in zip(tied, pairs)
             if "lm_head.weight" not in (e.fqn, e.tied_to)
             or not {e.fqn, e.tied_to} - {"lm_head.weight"} <= embeds]
    if other:
        raise ConfigError(f"pipeline: tied weights across the first and last stage other "
                          f"than the LM head's and the token embeddings' ({other}) are not "
                          f"supported; untie them")
    if plan.roles.fsdp:
        raise ConfigError(f"pipeline with the LM head tied to the token embeddings "
                          f"({pairs[0]}) beside parameter specs that shard over the data "
                          f"axis {plan.roles.fsdp!r} is not yet supported; use "
                          f"zero_shard(3) with unsharded specs, or build the model with "
                          f"tie_word_embeddings=False")
