"""Choosing each sequence's next token from its logits, as the config says.

Processors run in transformers' order (repetition penalty, no-repeat n-grams, then
temperature, top-k and top-p for sampling); greedy decoding takes the arg-max. The
sampling generator is seeded from the config, so every rank of a tensor-parallel group,
holding the same whole logits, draws the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._config import InferenceConfig


def _chunk(v: int) -> int | None:
    """The largest divisor of a vocabulary of ``v`` in [128, 1024], if any."""
    return next((c for c in range(min(1024, v // 4), 127, -1) if v % c == 0), None)


def greedy(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` of (S, V) logits, the first index among equal maxima as
    ``argmax`` gives. On CUDA, the Triton kernel of ``meshlab/ops/_triton_argmax.py`` in
    one launch; with the kernels off, for fewer than 16 rows, in two reductions: one
    row's arg-max over a vocabulary of 128k runs as one thread block (37 us on an H200,
    a twentieth of a Llama-1B decode step), while the maxima of the vocabulary's chunks
    reduce in parallel and then their arg-max is a short row."""
    if logits.is_cuda and not torch.compiler.is_compiling():
        from ..ops import _build

        mod = _build.triton_kernels("argmax")
        if mod is not None and mod.fits(logits):
            return mod.argmax(logits)
    c = _chunk(logits.shape[-1])
    if not logits.is_cuda or logits.shape[0] >= 16 or c is None:
        return logits.argmax(-1)
    return chunked_argmax(logits, c)


def chunked_argmax(logits: Tensor, c: int) -> Tensor:
    """``logits.argmax(-1)`` of (S, V) logits through the maxima of chunks of ``c`` (a
    divisor of V): the first chunk holding the row's maximum, its first maximum."""
    s, v = logits.shape
    vals, idx = logits.reshape(s, v // c, c).max(-1)    # first maximum within each chunk
    at = vals.argmax(-1, keepdim=True)                  # the first chunk holding the maximum
    return (at * c + idx.gather(-1, at)).squeeze(-1)


def _repetition(logits: Tensor, seen: list[int], penalty: float) -> Tensor:
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    got = logits[idx]
    logits[idx] = torch.where(got < 0, got * penalty, got / penalty)
    return logits


def _banned_ngrams(tokens: list[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in ``tokens``."""
    if len(tokens) + 1 < n:
        return []
    prefix = tuple(tokens[len(tokens) - n + 1:])
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1)
            if tuple(tokens[i:i + n - 1]) == prefix]


def _sample(logits: Tensor, cfg: InferenceConfig, gen: torch.Generator) -> int:
    if cfg.temperature is not None and cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    if cfg.top_k:
        k = min(cfg.top_k, logits.shape[-1])
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        srt, order = torch.sort(logits, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) >= cfg.top_p       # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                    float("-inf"))
    probs = logits.float().softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=gen))


def choose(logits: Tensor, histories: list[list[int]], force: list[int | None],
           cfg: InferenceConfig, gen: torch.Generator, best: Tensor | None = None) -> list[int]:
    """The next token of each sequence: ``logits`` (S, V), ``histories`` each sequence's
    prompt and generated tokens, ``force`` a token to emit regardless (forced EOS);
    ``best`` the rows' arg-max where the caller has it already (a replayed graph)."""
    plain = cfg.repetition_penalty in (None, 1.0) and not cfg.no_repeat_ngram_size
    if plain and not cfg.do_sample:         # greedy: one arg-max, one read of the device
        best = (greedy(logits) if best is None else best).tolist()
        return [b if f is None else f for b, f in zip(best, force)]
    out = []
    for row, seen, forced in zip(logits.float(), histories, force):
        if forced is not None:
            out.append(forced)
            continue
        if cfg.repetition_penalty not in (None, 1.0):
            row = _repetition(row.clone(), seen, cfg.repetition_penalty)
        if cfg.no_repeat_ngram_size:
            banned = _banned_ngrams(seen, cfg.no_repeat_ngram_size)
            if banned:
                row = row.index_fill(0, torch.tensor(banned, device=row.device), float("-inf"))
        out.append(_sample(row, cfg, gen) if cfg.do_sample else int(row.argmax()))
    return out
