"""Decoding a pipelined model: the stages run one after another on each step's packed
tokens, the hidden states sent point to point between the ranks that hold them.

Every rank runs the same scheduler on the same requests. The rank of the first stage
embeds the tokens; each stage runs its blocks (attention on its own layers' paged cache)
and sends the hidden states to the next stage's rank; the last stage's rank computes the
logits of each request's last position and chooses the tokens, which it broadcasts over
the pipeline group so that every rank appends the same ones. Stages run in turn (no
overlap of microbatches of requests): the pipeline splits the model's memory, not its
decode time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class PipelineDecoder:
    """The pipelined model's stages, as this rank runs them for decoding."""

    def __init__(self, model: nn.Module, rt, part):
        from ..parallel.pipeline import stages

        self.model, self.group = model, part.group
        self.all = stages(rt.plan)
        self.me = dist.get_rank(self.group)
        self.mine = {st.stage_index: st.submod for st in part.stages}
        self.last_rank = dist.get_global_rank(self.group, self.all[-1].rank)

    def _peer(self, stage) -> int:
        return dist.get_global_rank(self.group, stage.rank)

    def _blocks(self, mod, h, pos):
        base = getattr(self.model, self.model.base_model_prefix)
        pe = base.rotary_emb(h, pos)
        for i in mod.layer_ids:
            out = mod.layers[str(i)](h, attention_mask=None, position_ids=pos,
                                     position_embeddings=pe, use_cache=False)
            h = out[0] if isinstance(out, tuple) else out
        return h

    def logits(self, ids, pos, last, dtype):
        """The logits (S, V) of each request's last token on the last stage's rank, None
        on the others."""
        h, out = None, None
        hidden = self.model.config.hidden_size
        for i, s in enumerate(self.all):
            if s.rank != self.me:
                continue
            mod = self.mine[s.index]
            if s.first:
                h = mod.embed(ids)
            elif self.all[i - 1].rank != self.me:
                h = torch.empty(1, ids.shape[1], hidden, dtype=dtype, device=ids.device)
                dist.recv(h, self._peer(self.all[i - 1]), group=None)
            h = self._blocks(mod, h, pos)
            if s.last:
                out = mod.head(mod.norm(h[:, last]))[0]
            elif self.all[i + 1].rank != self.me:
                dist.send(h.contiguous(), self._peer(self.all[i + 1]))
        return out

    def share(self, tokens: list[int] | None, n: int, device) -> list[int]:
        """The last stage's ``tokens`` on every rank of the pipeline group."""
        t = torch.tensor(tokens if tokens is not None else [0] * n, dtype=torch.long,
                         device=device)
        dist.broadcast(t, self.last_rank, group=self.group)
        return t.tolist()
