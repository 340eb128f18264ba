"""Decoding a pipelined model: each step's packed tokens go through the stages, the hidden
states sent point to point between the ranks that hold them.

Every rank runs the same scheduler on the same requests. The rank of the first stage
embeds the tokens; each stage runs its blocks (attention on its own layers' paged cache)
and sends the hidden states to the next stage's rank; the last stage's rank computes the
logits of each request's last position and chooses the tokens, which it broadcasts over
the pipeline group so that every rank appends the same ones.

A step is a forward-only pipeline of micro-batches: the engine splits the running
requests into groups of ``micro_batch_size`` (by default one group: every request), each
packed in its own row with its own ``PagedBatch``. A rank runs, for each of its stages and
each micro-batch in order, the receive of its input (from the previous stage's rank), its
blocks under ``running(that micro-batch's batch)``, and a non-blocking ``isend`` of the
hidden states to the next stage's rank (the sends are waited on at the end of the step,
or, with ``micro_batch_buffer_size`` b, the oldest before a rank would have more than b
of them in flight): the next stage works on micro-batch i while this one computes
micro-batch i + 1. The last
stage's logits of every micro-batch are concatenated in the requests' order, so the
tokens are chosen (and sampled, the generator drawing in the same order) as without
micro-batches. With one micro-batch the stages run in turn: the pipeline then splits the
model's memory, not its decode time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ._paged import running


class PipelineDecoder:
    """The pipelined model's stages, as this rank runs them for decoding."""

    def __init__(self, model: nn.Module, rt, part):
        from ..transforms.pipeline import stages

        self.model, self.group = model, part.group
        self.all = stages(rt.plan)
        self.me = dist.get_rank(self.group)
        self.mine = {st.stage_index: st.submod for st in part.stages}
        self.last_rank = dist.get_global_rank(self.group, self.all[-1].rank)
        self.failed: BaseException | None = None      # a stage of this rank raised
        self.tied = part.tied       # a head tied to the embeddings on another rank
        from ..core.errors import ConfigError
        from ..transforms.pipeline._stage import LAYOUTS, model_layout

        if model_layout(model) is not LAYOUTS[0]:
            raise ConfigError(f"InferenceEngine on a pipelined {type(model).__name__}: "
                              f"meshlab decodes pipelined models laid out as "
                              f"{LAYOUTS[0].name} (Llama-like); parallelize it without "
                              f"pipeline() for decoding, or with shard() alone")

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

    def logits(self, micro, dtype, buffer: int | None = None):
        """The logits (S, V) of each request's last token on the last stage's rank, None
        on the others. ``micro``: the step's micro-batches in the requests' order, each
        ``(ids (1, T), pos (1, T), last, batch)``; the stages run on them as a pipeline
        (module docstring), at most ``buffer`` sends in flight from this rank."""
        hs, out, sends = [None] * len(micro), [], []
        if self.tied is not None:       # the last stage's copy of a tied head is current
            self.tied.refresh_if_changed()
        for i, s in enumerate(self.all):
            if s.rank != self.me:
                continue
            mod = self.mine[s.index]
            for j, (ids, pos, last, batch) in enumerate(micro):
                h = self._stage(s, mod, self._input(i, ids, hs[j], dtype), ids, pos, last,
                                batch, dtype)
                if s.last:
                    out.append(h)
                elif self.all[i + 1].rank != self.me:
                    h = h.contiguous()
                    if buffer is not None and len(sends) >= buffer:
                        sends.pop(0).wait()
                    sends.append(dist.isend(h, self._peer(self.all[i + 1])))
                hs[j] = h
        for w in sends:
            w.wait()
        return torch.cat(out) if out else None

    def _stage(self, s, mod, h, ids, pos, last, batch, dtype):
        """Stage ``s`` on one micro-batch: its blocks on ``h`` (the tokens, on the first
        stage), and on the last the logits (S, V) of each request's last position. An
        exception is kept (``take_failed``) and zeros of the shape the next stage waits
        for go on, so no rank is left in a receive or a broadcast for good; the step then
        fails on this rank after its collectives (``_agree``)."""
        try:
            if s.first:
                h = mod.embed(ids)
            with running(batch):
                h = self._blocks(mod, h, pos)
            return mod.head(mod.norm(h[:, last]))[0] if s.last else h
        except Exception as e:      # raised after the step's collectives, see above
            self.failed = self.failed or e
            cfg = self.model.config
            shape = (len(last), cfg.vocab_size) if s.last else (1, ids.shape[1],
                                                                 cfg.hidden_size)
            return torch.zeros(shape, dtype=dtype, device=ids.device)

    def take_failed(self) -> BaseException | None:
        """The first exception a stage of this rank raised since the last call."""
        error, self.failed = self.failed, None
        return error

    def _input(self, i: int, ids, h, dtype):
        """Stage ``i``'s input: the tokens, the hidden states this rank's previous stage
        left (``h``), or those received from the previous stage's rank."""
        s = self.all[i]
        if s.first:
            return ids
        if self.all[i - 1].rank == self.me:
            return h
        h = torch.empty(1, ids.shape[1], self.model.config.hidden_size, dtype=dtype,
                        device=ids.device)
        dist.recv(h, self._peer(self.all[i - 1]))
        return h

    def share(self, tokens: list[int] | None, n: int, device) -> list[int]:
        """The last stage's ``tokens`` on every rank of the pipeline group."""
        t = None if tokens is None else torch.tensor(tokens, dtype=torch.long)
        return self.share_tensor(t, (n,), device, torch.long).tolist()

    def share_tensor(self, t, shape, device, dtype=torch.float64):
        """The last stage's tensor ``t`` (None on the other ranks) of ``shape`` and
        ``dtype`` on every rank of the pipeline group."""
        t = torch.empty(shape, dtype=dtype, device=device) if t is None else \
            t.to(device=device, dtype=dtype)
        dist.broadcast(t, self.last_rank, group=self.group)
        return t
