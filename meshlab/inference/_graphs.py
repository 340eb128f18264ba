"""CUDA graphs of decode steps (``InferenceConfig(use_cuda_graph=True)``).

A step where every running request decodes one token has the same shapes for a given
number of requests, so it is captured once per batch size bucket (1, 2, 4, ... up to
``max_batch_size``) and replayed: the model's whole forward becomes one launch. The graph
reads static buffers: the tokens and positions, each token's cache slot, the block tables
padded to a request's largest budget, and the mask of the keys each request has. Rows
beyond the running requests write to a scratch block of the cache and are ignored. A
step with a prompt in it (prefill) runs eagerly. Refused: a parallelized model, a model
off the GPU, and budgets of more than ``max_context_len_to_capture`` tokens.

Greedy decoding runs one step ahead of the host (``launch`` / ``read``): every replay
writes its rows' arg-max into one device buffer, and a row of the next step may take its
token from there (its index in ``rows``) instead of from the host. So the engine launches
step t+1 before it reads step t's tokens, and the GPU runs t+1 while the host appends,
retires and fills the next inputs: the host's work per step is hidden instead of added.
A request that step t ends (EOS) has run one step too many; its result is dropped, and
what that step wrote lies in the request's own blocks, before (in stream order) any later
request's use of them. Each bucket's pinned inputs and the host copies of the tokens
alternate between two buffers, so a buffer is refilled only after the step that read it
has been waited for.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..ops.paged_attention import Layout
from ._paged import PagedBatch, place, running
from ._sampling import greedy


@dataclasses.dataclass
class Launch:
    """A decode step replayed and not read yet: its requests in row order, the host
    buffer its tokens arrive in, and the event after their copy."""

    reqs: list
    tokens: torch.Tensor
    done: object


class DecodeGraphs:
    """Captured decode steps of one engine, by batch size bucket. ``capture=False`` runs
    the same static-buffer steps eagerly (no graph, no pinned memory): the scheduling
    around the graphs, on a machine without a GPU."""

    def __init__(self, engine, capture: bool = True):
        cfg = engine.config
        self.engine, self.capture = engine, capture
        self.width = math.ceil((cfg.max_input_len + cfg.max_output_len) / cfg.block_size)
        self.scratch = engine.cache.num_blocks - 1           # reserved by the engine
        self.graphs: dict[int, tuple] = {}
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                        if b < cfg.max_batch_size] + [cfg.max_batch_size]
        n, dev = cfg.max_batch_size, engine.device
        self.last = torch.zeros(n, dtype=torch.long, device=dev)   # each row's latest arg-max
        self.tokens = [self._host(torch.empty(n, dtype=torch.long)) for _ in range(2)]
        self.launched = self.read_count = 0

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.capture else t

    def _event(self):
        if not self.capture:
            return None
        e = torch.cuda.Event()
        e.record()
        return e

    def _buffers(self, n: int):
        dev, bs = self.engine.device, self.engine.config.block_size
        keys, w = self.width * bs, self.width
        # The per-step inputs are views of one device buffer, filled by one copy from a
        # pinned twin: ids, positions, slots, key counts, rows (n each), then the tables.
        flat = torch.empty((5 + w) * n, dtype=torch.long, device=dev)
        b = dict(flat=flat, pinned=[self._host(torch.empty_like(flat, device="cpu"))
                                    for _ in range(2)],
                 copied=[None, None], turn=0,
                 ids=flat[:n].view(1, n), pos=flat[n:2 * n].view(1, n),
                 slots=flat[2 * n:3 * n], lens=flat[3 * n:4 * n],
                 rows=flat[4 * n:5 * n].view(1, n), tables=flat[5 * n:].view(n, w),
                 mask=torch.zeros(n, 1, 1, keys, dtype=torch.bool, device=dev),
                 last=torch.arange(n, device=dev), keys=torch.arange(keys, device=dev))
        self._fill(b["pinned"][0], [], n)
        b["flat"].copy_(b["pinned"][0])
        return b

    def _fill(self, h: torch.Tensor, reqs, n: int) -> None:
        """Write the step's inputs of ``reqs`` into the host buffer ``h``, rows past them
        pointing at the scratch block. A request with a token launched and not read
        takes it from ``self.last`` at its row of the previous step."""
        bs, w = self.engine.config.block_size, self.width
        h = h.numpy()
        h[:] = 0
        h[2 * n:3 * n] = self.scratch * bs
        h[3 * n:4 * n] = 1
        h[4 * n:5 * n] = -1
        tables = h[5 * n:].reshape(n, w)
        tables[:] = self.scratch
        for i, r in enumerate(reqs):
            if r.pending:
                h[4 * n + i] = r.row
            else:
                h[i] = r.generated[-1]
            h[n + i] = r.cached
            h[2 * n + i] = place(r, r.cached, bs, self.engine.window)
            h[3 * n + i] = r.cached + 1 - r.dropped * bs        # the keys it keeps
            tables[i, :len(r.blocks)] = r.blocks

    def _forward(self, b: dict):
        from ..transforms.shard._styles import whole_logits

        n = b["ids"].shape[1]
        rows = b["rows"]
        ids = torch.where(rows >= 0, self.last[rows.clamp(min=0)], b["ids"])
        where = Layout(b["tables"], b["last"], torch.zeros_like(b["last"]), b["mask"],
                       b["lens"])
        batch = PagedBatch(self.engine.cache, b["slots"], b["tables"], [1] * n,
                           list(range(n + 1)), where)
        torch.lt(b["keys"][None, :], b["lens"][:, None], out=b["mask"][:, 0, 0])
        with torch.no_grad(), running(batch), whole_logits():
            out = self.engine.model(input_ids=ids, position_ids=b["pos"], use_cache=False,
                                    logits_to_keep=b["last"]).logits[0]
        best = greedy(out)                          # the greedy choice, in the same replay
        self.last[:n].copy_(best)
        return out, best

    def _graph(self, n: int):
        if n in self.graphs:
            return self.graphs[n]
        b = self._buffers(n)
        if not self.capture:
            self.graphs[n] = (None, b, None, None)
            return self.graphs[n]
        held = self.last.clone()        # a launched step's tokens, which warm-up overwrites
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                      # warm-up: allocations, lazy inits
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, best = self._forward(b)
        self.last.copy_(held)
        self.graphs[n] = (g, b, out, best)
        return self.graphs[n]

    def logits(self, reqs):
        """Fill the inputs of ``reqs``, copy them over and replay their bucket's step; its
        next-token logits (len(reqs), V) and each row's arg-max (len(reqs),), as buffers
        the next replay of the bucket writes over (sampling reads them at once)."""
        n = len(reqs)
        bucket = next(k for k in self.buckets if k >= n)
        g, b, out, best = self._graph(bucket)
        turn = b["turn"]
        b["turn"] ^= 1
        if b["copied"][turn] is not None:           # the step that read this buffer
            b["copied"][turn].synchronize()
        self._fill(b["pinned"][turn], reqs, bucket)
        b["flat"].copy_(b["pinned"][turn], non_blocking=self.capture)
        b["copied"][turn] = self._event()
        if g is None:
            out, best = self._forward(b)
        else:
            g.replay()
        return out[:n], best[:n]

    def launch(self, reqs) -> Launch:
        """Replay a greedy decode step of ``reqs`` without waiting for it: each request's
        ``cached`` moves on by its token, which is ``pending`` until ``read``."""
        _, best = self.logits(reqs)
        host = self.tokens[self.launched % 2][:len(reqs)]
        host.copy_(best, non_blocking=self.capture)
        for i, r in enumerate(reqs):
            r.row, r.pending, r.cached = i, r.pending + 1, r.cached + 1
        self.launched += 1
        return Launch(list(reqs), host, self._event())

    def read(self, step: Launch) -> list[int]:
        """Wait for ``step`` and return its tokens, one per request in row order."""
        if step.done is not None:
            step.done.synchronize()
        self.read_count += 1
        for r in step.reqs:
            r.pending -= 1
        return step.tokens.tolist()
