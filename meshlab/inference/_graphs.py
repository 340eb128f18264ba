"""CUDA graphs of decode steps (``InferenceConfig(use_cuda_graph=True)``).

A step where every running request decodes one token has the same shapes for a given
number of requests, so it is captured once per batch size bucket (1, 2, 4, ... up to
``max_batch_size``) and replayed: the model's whole forward becomes one launch. The graph
reads static buffers: the tokens and positions, each token's cache slot, the block tables
padded to a request's largest budget, and the mask of the keys each request has. Rows
beyond the running requests write to a scratch block of the cache and are ignored. A
step with a prompt in it (prefill) runs eagerly. Refused: a parallelized model, a model
off the GPU, and budgets of more than ``max_context_len_to_capture`` tokens.
"""

from __future__ import annotations

import math

import torch

from ..ops.paged_attention import Layout
from ._paged import PagedBatch, running


class DecodeGraphs:
    """Captured decode steps of one engine, by batch size bucket."""

    def __init__(self, engine):
        cfg = engine.config
        self.engine = engine
        self.width = math.ceil((cfg.max_input_len + cfg.max_output_len) / cfg.block_size)
        self.scratch = engine.cache.num_blocks - 1           # reserved by the engine
        self.graphs: dict[int, tuple] = {}
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                        if b < cfg.max_batch_size] + [cfg.max_batch_size]

    def _buffers(self, n: int):
        dev, bs = self.engine.device, self.engine.config.block_size
        keys, w = self.width * bs, self.width
        # The per-step inputs are views of one device buffer, filled by one copy from a
        # pinned twin: ids, positions, slots, key counts (n each), then the tables.
        flat = torch.empty((4 + w) * n, dtype=torch.long, device=dev)
        pinned = torch.empty_like(flat, device="cpu").pin_memory()
        b = dict(flat=flat, pinned=pinned, ids=flat[:n].view(1, n), pos=flat[n:2 * n].view(1, n),
                 slots=flat[2 * n:3 * n], lens=flat[3 * n:4 * n],
                 tables=flat[4 * n:].view(n, w),
                 mask=torch.zeros(n, 1, 1, keys, dtype=torch.bool, device=dev),
                 last=torch.arange(n, device=dev), keys=torch.arange(keys, device=dev))
        self._fill(b, [], n)
        b["flat"].copy_(b["pinned"])
        return b

    def _fill(self, b: dict, reqs, n: int) -> None:
        """Write the step's inputs of ``reqs`` into the pinned buffer, rows past them
        pointing at the scratch block."""
        bs, w, k = self.engine.config.block_size, self.width, len(reqs)
        h = b["pinned"].numpy()
        h[:] = 0
        h[2 * n:3 * n] = self.scratch * bs
        h[3 * n:4 * n] = 1
        tables = h[4 * n:].reshape(n, w)
        tables[:] = self.scratch
        for i, r in enumerate(reqs):
            h[i], h[n + i] = r.generated[-1], r.cached
            h[2 * n + i] = r.blocks[r.cached // bs] * bs + r.cached % bs
            h[3 * n + i] = r.cached + 1
            tables[i, :len(r.blocks)] = r.blocks

    def _forward(self, b: dict):
        from ..parallel.shard._styles import whole_logits

        n = b["ids"].shape[1]
        where = Layout(b["tables"], b["last"], torch.zeros_like(b["last"]), b["mask"],
                       b["lens"])
        batch = PagedBatch(self.engine.cache, b["slots"], b["tables"], [1] * n,
                           list(range(n + 1)), where)
        torch.lt(b["keys"][None, :], b["lens"][:, None], out=b["mask"][:, 0, 0])
        with torch.no_grad(), running(batch), whole_logits():
            return self.engine.model(input_ids=b["ids"], position_ids=b["pos"],
                                     use_cache=False, logits_to_keep=b["last"]).logits[0]

    def _capture(self, n: int):
        b = self._buffers(n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                      # warm-up: allocations, lazy inits
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self._forward(b)
            best = out.argmax(-1)                   # the greedy choice, in the same replay
        self.graphs[n] = (g, b, out, best)

    def logits(self, reqs):
        """The next-token logits (len(reqs), V) of a decode step, replayed, and each row's
        arg-max (len(reqs),)."""
        n = len(reqs)
        bucket = next(k for k in self.buckets if k >= n)
        if bucket not in self.graphs:
            self._capture(bucket)
        g, b, out, best = self.graphs[bucket]
        self._fill(b, reqs, bucket)
        b["flat"].copy_(b["pinned"], non_blocking=True)
        g.replay()
        return out[:n], best[:n]
