"""Beam search (``InferenceConfig(beam_width=w)``): transformers' ``generate(num_beams=w,
do_sample=False, length_penalty=1.0, early_stopping=...)`` token for token, per request.

A request runs ``w`` beams, each a sequence of the engine's packed step with a block list
of its own; the blocks of all ``w`` budgets are reserved at admission and freed when the
request leaves. The prompt is filled once, into beam 0's blocks. Each step then follows
transformers' ``_beam_search`` for one prompt alone, with the same tensor operations on
the same float32 values (so ties fall as there, by ``torch.topk``'s order):

- the step's logits in float32, ``log_softmax``, plus each running beam's score (at the
  prompt, every beam is the prompt: scores 0, -1e9, ...); of the ``w * vocab`` candidates
  the top ``max(2, 1 + n_eos) * w`` are kept;
- a candidate ends its hypothesis when its token is an EOS or it reaches
  ``max_new_tokens``; one that ends and ranks among the top ``w`` candidates is offered
  to the finished set, its score divided by its generated length (EOS included, prompt
  excluded) to the power ``length_penalty`` (1.0), and the finished set keeps the best
  ``w``;
- the best ``w`` candidates that did not end are the next running beams;
- the search stops when every candidate ended (the budget), with ``early_stopping=True``
  when ``w`` hypotheses are finished, otherwise when ``w`` are finished and the best
  running score divided by the generated length (``"never"``: by ``max_new_tokens``)
  cannot beat the worst finished one. The request's tokens are the best finished
  hypothesis.

When the running beams are reordered, the first new beam of each parent takes the
parent's blocks as they are; each further child takes the blocks of a beam that has no
child and gets the parent's cached blocks copied into them (``PagedCache.copy_blocks``),
in every layer. Under tensor parallelism every rank holds the same whole logits, so every
rank makes the same choices and copies its own K/V heads. On a pipelined model the last
stage's rank alone has the logits: it takes each request's top candidates (scores, parent
beams, tokens: ``max(2, 1 + n_eos) * w`` of each) and broadcasts them over the pipeline
group, and every rank goes on from them alike, copying the blocks of its own layers.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

LENGTH_PENALTY = 1.0        # transformers' default; InferenceConfig has no field for it
_NONE = -1.0e9              # transformers' score of "no such beam"


@dataclasses.dataclass
class Beam:
    """One running beam: a sequence of the engine's step (as a ``Request`` is one)."""

    prompt: list[int]
    generated: list[int]
    blocks: list[int]
    cached: int = 0
    dropped: int = 0                # never: StreamingLLM refuses beam search


@dataclasses.dataclass
class Search:
    """One request's beam search: transformers' per-prompt state, with (1, w) tensors."""

    beams: list[Beam]
    spare: list[list[int]]          # block lists no running beam holds
    running: Tensor                 # the running beams' scores
    best: Tensor                    # the finished hypotheses' scores (-1e9: none yet)
    finished: Tensor                # bool: a slot of ``best`` holds a finished hypothesis
    hyps: list[list[int]]           # the generated tokens of each slot of ``best``
    open: bool = True               # transformers' is_early_stop_heuristic_unsatisfied


class BeamSearch:
    """The beam searches of an engine's running requests (``engine.beam``)."""

    def __init__(self, engine):
        self.engine = engine
        self.w = engine.config.beam_width
        self.keep = max(2, 1 + len(engine.eos)) * self.w
        self.searches: dict[int, Search] = {}

    def admit(self, r, need: int) -> None:
        """Search ``r``: its blocks (``need`` each) become beam 0's, ``w - 1`` more lists
        are taken; the request holds none itself while it runs."""
        w = self.w
        spare = [self.engine.blocks.take(need) for _ in range(w - 1)]
        dev = self.engine.device
        running = torch.full((1, w), _NONE, dtype=torch.float32, device=dev)
        running[0, 0] = 0.0
        self.searches[r.rid] = Search(
            [Beam(r.prompt, [], r.blocks)], spare, running,
            torch.full((1, w), _NONE, dtype=torch.float32, device=dev),
            torch.zeros((1, w), dtype=torch.bool, device=dev), [[] for _ in range(w)])
        r.blocks = []

    def step(self, engine) -> list:
        """One step of every running request's beams; returns the requests that finished."""
        reqs = engine.running
        seqs = [b for r in reqs for b in self.searches[r.rid].beams]
        logits, lens = engine._eager(seqs=seqs)
        for b, n in zip(seqs, lens):
            b.cached = n
        cands = self._candidates(reqs, logits)
        if engine.pipe is not None:         # the last stage's candidates on every rank
            cands = engine.pipe.share_tensor(cands, (len(reqs), 3, self.keep), engine.device)
        pairs, finished = [], []
        for r, (top, parent, token) in zip(reqs, cands):
            s = self.searches[r.rid]
            parents, tokens, done = self._advance(s, top[None].float(), parent.long().tolist(),
                                                  token.long().tolist(), r.max_new_tokens)
            if done:
                finished.append(self._finish(r))
            else:
                pairs += _fork(s, parents, tokens, engine.config.block_size)
        if pairs:
            engine.cache.copy_blocks([a for a, _ in pairs], [b for _, b in pairs])
        engine.running = [r for r in reqs if not r.done]
        return finished

    def _finish(self, r):
        s = self.searches.pop(r.rid)
        r.generated, r.done = list(s.hyps[0]), True
        for blocks in [b.blocks for b in s.beams] + s.spare:
            self.engine.blocks.give(blocks)
        return r

    def _candidates(self, reqs, logits: Tensor | None) -> Tensor | None:
        """Each request's top ``keep`` candidates of transformers' step, (requests, 3,
        keep) float64: their scores (float32 values), parent beams and tokens; None
        without the logits (a pipeline rank without the last stage)."""
        if logits is None:
            return None
        out, at = [], 0
        for r in reqs:
            s = self.searches[r.rid]
            rows, at = logits[at:at + len(s.beams)], at + len(s.beams)
            lp = torch.log_softmax(rows.to(torch.float32), dim=-1)
            if lp.shape[0] == 1:                # the prompt: every beam is it
                lp = lp.expand(self.w, -1)
            vocab = lp.shape[-1]
            top, idx = torch.topk((lp + s.running[0][:, None]).reshape(1, -1), k=self.keep)
            parent = idx // vocab if len(s.beams) > 1 else torch.zeros_like(idx)
            out.append(torch.cat([top.double(), parent.double(), (idx % vocab).double()]))
        return torch.stack(out)

    def _advance(self, s: Search, top: Tensor, parent: list[int], token: list[int],
                 max_new: int):
        """transformers' step for one prompt from its candidates (``top`` (1, keep)
        scores, their parent beams and tokens): the next running beams' parents (indices
        into ``s.beams``) and tokens, and whether the search is over."""
        w, eos = self.w, self.engine.eos
        g = len(s.beams[0].generated) + 1       # generated tokens, this one included
        hits = torch.tensor([[t in eos or g >= max_new for t in token]], device=top.device)
        # the running beams: the best candidates that did not end
        ranked = top + hits.to(torch.float32) * _NONE
        nxt = torch.topk(ranked, k=w)[1]
        s.running = torch.take_along_dim(ranked, nxt, dim=1)
        # the finished hypotheses: the first w candidates that ended, by normalized score
        did = hits.clone()
        did[:, w:] = False
        cand = top / (g ** LENGTH_PENALTY) + (~did) * _NONE
        merged = torch.cat((s.best, cand), dim=1)
        sel = torch.topk(merged, k=w)[1]
        s.best = torch.take_along_dim(merged, sel, dim=1)
        s.finished = torch.take_along_dim(torch.cat((s.finished, did), dim=1), sel, dim=1)
        hyps = s.hyps + [s.beams[p].generated + [t] for p, t in zip(parent, token)]
        s.hyps = [hyps[i] for i in sel[0].tolist()]
        done = self._stopped(s, hits, g, max_new)
        nxt = nxt[0].tolist()
        return [parent[i] for i in nxt], [token[i] for i in nxt], done

    def _stopped(self, s: Search, hits: Tensor, g: int, max_new: int) -> bool:
        """transformers' stopping test of one prompt's search after a step. (Its penalties
        for a prompt whose search is full or cannot improve apply only once the search has
        stopped; here the request leaves at once, so they never arise.)"""
        early = self.engine.config.early_stopping
        length = max_new if early == "never" and LENGTH_PENALTY > 0.0 else g
        best_running = s.running[:, :1] / (length ** LENGTH_PENALTY)
        worst = torch.where(s.finished, torch.min(s.best, dim=1, keepdim=True)[0], _NONE)
        s.open = s.open and bool(torch.any(best_running > worst))
        full = bool(s.finished.all()) and early is True
        return not s.open or full or bool(hits.all())


def _fork(s: Search, parents: list[int], tokens: list[int], bs: int) -> list[tuple[int, int]]:
    """The next running beams of ``s``: a parent's first child takes its blocks, each
    further child the blocks of a beam with no child; returns the (source, destination)
    blocks to copy, the cached blocks of each further child's parent."""
    old, have = s.beams, set(parents)
    free = s.spare + [b.blocks for i, b in enumerate(old) if i not in have]
    claimed, beams, pairs = set(), [], []
    for p, t in zip(parents, tokens):
        src = old[p]
        if p in claimed:
            blocks = free.pop()
            n = math.ceil(src.cached / bs)
            pairs += zip(src.blocks[:n], blocks[:n])
        else:
            claimed.add(p)
            blocks = src.blocks
        beams.append(Beam(src.prompt, src.generated + [t], blocks, src.cached))
    s.beams, s.spare = beams, free
    return pairs
