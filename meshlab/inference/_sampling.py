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


def _seen_mask(histories: list[list[int]], v: int, device) -> Tensor:
    """(S, V) booleans: the tokens each row's history holds (one transfer to the device)."""
    width = max((len(h) for h in histories), default=0) or 1
    idx = torch.full((len(histories), width), v, dtype=torch.long)
    for i, h in enumerate(histories):
        idx[i, :len(h)] = torch.tensor(h, dtype=torch.long)
    mask = torch.zeros(len(histories), v + 1, dtype=torch.bool, device=device)
    return mask.scatter_(1, idx.to(device), True)[:, :v]


def _repetition(logits: Tensor, histories: list[list[int]], penalty: float) -> Tensor:
    """transformers' repetition penalty on every row at once: a seen token's logit is
    divided by ``penalty`` (multiplied where negative)."""
    seen = _seen_mask(histories, logits.shape[-1], logits.device)
    pen = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, pen, logits)


def _banned_ngrams(tokens: list[int], n: int) -> list[int]:
    """Tokens that would repeat an n-gram already in ``tokens``."""
    if len(tokens) + 1 < n:
        return []
    prefix = tuple(tokens[len(tokens) - n + 1:])
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1)
            if tuple(tokens[i:i + n - 1]) == prefix]


def _filtered(logits: Tensor, cfg: InferenceConfig) -> Tensor:
    """Temperature, top-k and top-p over every row at once (rows of (S, V))."""
    if cfg.temperature is not None and cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    if cfg.top_k:
        k = min(cfg.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        srt, order = torch.sort(logits, dim=-1, descending=True)
        p = srt.softmax(-1)
        drop = p.cumsum(-1) - p >= cfg.top_p       # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop),
                                    float("-inf"))
    return logits


def choose(logits: Tensor, histories: list[list[int]], force: list[int | None],
           cfg: InferenceConfig, gen: torch.Generator, best: Tensor | None = None) -> list[int]:
    """The next token of each sequence: ``logits`` (S, V), ``histories`` each sequence's
    prompt and generated tokens, ``force`` a token to emit regardless (forced EOS);
    ``best`` the rows' arg-max where the caller has it already (a replayed graph).

    Every row is processed at once on the device and read once: the sampled rows draw
    from one ``torch.multinomial`` over their probabilities (the generator's draws in row
    order, as one row at a time would take them; forced rows draw nothing)."""
    plain = cfg.repetition_penalty in (None, 1.0) and not cfg.no_repeat_ngram_size
    if plain and not cfg.do_sample:         # greedy: one arg-max, one read of the device
        best = (greedy(logits) if best is None else best).tolist()
        return [b if f is None else f for b, f in zip(best, force)]
    rows = [i for i, f in enumerate(force) if f is None]
    out = list(force)
    if not rows:
        return out
    x = logits[rows].float()
    hist = [histories[i] for i in rows]
    if cfg.repetition_penalty not in (None, 1.0):
        x = _repetition(x, hist, cfg.repetition_penalty)
    if cfg.no_repeat_ngram_size:
        banned = [_banned_ngrams(h, cfg.no_repeat_ngram_size) for h in hist]
        if any(banned):
            x = x.masked_fill(_seen_mask(banned, x.shape[-1], x.device), float("-inf"))
    if cfg.do_sample:
        probs = _filtered(x, cfg).softmax(-1).cpu()
        picked = torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()
    else:
        picked = x.argmax(-1).tolist()
    for i, tok in zip(rows, picked):
        out[i] = tok
    return out
