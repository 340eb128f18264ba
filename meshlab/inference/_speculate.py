"""Greedy speculative decoding: a draft model proposes, the model checks in one pass.

Each step, for every running request, the drafter (an engine of its own over its own paged
cache, running the same requests) decodes ``k`` tokens greedily, catching up first on the
tokens the model accepted since it last ran. The model then runs once on each request's
last token and the ``k`` drafted ones (a chunk like a prefill's, its logits kept at every
position) and takes the longest run of drafted tokens equal to its own arg-max, plus its
own token after that run: between 1 and ``k + 1`` tokens per step, and the same tokens as
the model decoding greedily alone. Cache entries past what is kept are simply written over
later (attention reads only a request's kept length), so nothing is rolled back.

Only plain greedy decoding is checked this way; sampling, the repetition penalty,
n-gram bans and a forced EOS choose tokens position by position from histories the
verification does not replay, so they are refused, as are beam search and CUDA graphs
(they capture a one-token step). On a pipelined model the check runs through the stages
and the last stage's rank broadcasts its arg-max at every position; the drafter runs whole
on every rank, so each drafts the same tokens.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..core.errors import ConfigError
from ..transforms._install import runtime_or_none


def spec_tokens(engine, drafter: nn.Module, k: int | None) -> int:
    """The tokens drafted per step (``max_n_spec_tokens`` by default), once the engine and
    the drafter are checked for speculation."""
    k = engine.config.max_n_spec_tokens if k is None else k
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"enable_spec_dec(n_spec_tokens={k!r}): a positive integer")
    _check(engine, drafter)
    return k


def draft_config(cfg, k: int):
    """The drafter engine's config: the model's budget plus the ``k`` tokens it drafts past
    it, on one process, without graphs."""
    return dataclasses.replace(cfg, use_spec_dec=False, use_cuda_graph=False, tp_size=1,
                               max_output_len=cfg.max_output_len + k)


class Speculator:
    """The drafter's engine (``draft``, built by ``draft_config``) beside an
    ``InferenceEngine``, and its counts (``proposed``, ``accepted``)."""

    def __init__(self, draft, k: int):
        self.draft, self.k = draft, k
        self.mirror: dict[int, object] = {}
        self.proposed = self.accepted = 0

    def admit(self, r, need: int) -> None:
        """The drafter's copy of a request the engine admitted, with blocks of its own."""
        d = dataclasses.replace(r, generated=[], blocks=self.draft.blocks.take(need), cached=0)
        self.mirror[r.rid] = d

    def release(self, r) -> None:
        d = self.mirror.pop(r.rid)
        self.draft.blocks.give(d.blocks)

    def step(self, engine) -> list:
        """One speculative step of every running request (each has its prompt cached)."""
        running = engine.running
        drafts = [self.mirror[r.rid] for r in running]
        for r, d in zip(running, drafts):
            d.generated = list(r.generated)
        self.draft.running = drafts
        for _ in range(self.k):
            logits, lens = self.draft._eager()
            for d, t, n in zip(drafts, logits.argmax(-1).tolist(), lens):
                d.cached = n
                d.generated.append(t)
        kept = [r.generated for r in running]
        for r, d in zip(running, drafts):
            r.generated = list(d.generated)         # the kept tokens and the k drafted
        logits, _ = engine._eager(every_position=True)
        best = None if logits is None else logits.argmax(-1).tolist()
        if engine.pipe is not None:         # the last stage's choices on every rank
            best = engine.pipe.share(best, len(running) * (self.k + 1), engine.device)
        at = 0
        for r, d, mine in zip(running, drafts, kept):
            proposed = r.generated[len(mine):]
            own = best[at:at + self.k + 1]          # after the last kept token, then each draft
            at += self.k + 1
            n = 0
            while n < self.k and proposed[n] == own[n]:
                n += 1
            self.proposed += self.k
            self.accepted += n
            r.generated = mine + _until_done(proposed[:n] + [own[n]], engine.eos,
                                             r.max_new_tokens - len(mine))
            r.cached += 1 + n                       # the last kept token and the n accepted
            d.cached = min(d.cached, len(r.prompt) + len(mine) + n)
        self.draft.running = []
        return engine._retire()


def _until_done(tokens: list[int], eos: set, room: int) -> list[int]:
    """``tokens`` up to and including the first EOS, at most ``room`` of them."""
    out = []
    for t in tokens[:room]:
        out.append(t)
        if t in eos:
            break
    return out


def _check(engine, drafter: nn.Module) -> None:
    cfg = engine.config
    for name, plain in (("do_sample", (False,)), ("repetition_penalty", (1.0, None)),
                        ("no_repeat_ngram_size", (0, None)), ("forced_eos_token_id", (None,)),
                        ("use_cuda_graph", (False,)), ("beam_width", (1,))):
        value = getattr(cfg, name)
        if value not in plain:
            raise ConfigError(f"speculative decoding with InferenceConfig({name}={value!r}): "
                              f"drafted tokens are checked against plain greedy decoding "
                              f"only; set {name}={plain[0]!r} or leave use_spec_dec off")
    mine = engine.model.config.vocab_size
    theirs = getattr(getattr(drafter, "config", None), "vocab_size", None)
    if theirs != mine:
        raise ConfigError(f"enable_spec_dec: the drafter's vocabulary has {theirs} tokens, the "
                          f"model's {mine}; draft with a model of the same tokenizer")
    if any(p.device != engine.device for p in drafter.parameters()):
        raise ConfigError(f"enable_spec_dec: put the drafter on {engine.device}, where the "
                          f"model is")
    if runtime_or_none(drafter) is not None:
        raise ConfigError("enable_spec_dec: the drafter runs whole on every rank; give it "
                          "unparallelized")

