"""``InferenceEngine``: continuous batching of requests over a paged KV cache.

Each ``step`` admits waiting requests while fewer than ``max_batch_size`` run and the
cache has the blocks for their whole budget (prompt + ``max_new_tokens``, reserved at
admission, so a running request is never evicted), then runs the model once on every
running request's new tokens packed in one row: a newly admitted prompt whole (its
prefill), one token for each of the others (decode). The last position of each request
gives its next token; a request that emits EOS or reaches its budget leaves and frees its
blocks, and a waiting one takes its place at the next step. Requests may be added between
steps (``add_request``) and finish in any order.

With a drafter (``use_spec_dec``, ``_speculate``) a step of requests that are all decoding
checks the drafter's tokens instead, keeping up to ``max_n_spec_tokens + 1`` per request.
Under beam search (``beam_width`` w > 1, ``_beam``) every request runs w beams, each a
sequence of the packed step with blocks of its own (w budgets reserved at admission), and
``max_batch_size`` counts beams: at most ``max_batch_size // w`` requests run together.

Under tensor parallelism every rank runs the same steps on the same requests (SPMD): each
attention layer caches its own K/V heads, the vocabulary-split head gathers the whole
logits, and every rank chooses the same tokens. A pipelined model runs its stages on the
step (``_pipeline``), split into micro-batches of ``micro_batch_size`` requests that
overlap across the stages when it is above 1: the last stage's rank chooses the tokens of
all of them and broadcasts them.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch import nn

from ..core.errors import ConfigError, ConfigTypeError
from ..core.placement import mesh_repr
from ..ops.paged_attention import layout
from ..transforms._install import runtime_of, runtime_or_none
from ._generation import eos_ids, unread_generation_config
from ._load import load_pretrained
from ._agree import StepAgreement, agreed_step
from ._config import InferenceConfig, check_vocab, window_blocks
from ._merge import merged_of
from ._paged import Blocks, PagedBatch, PagedCache, place, register, running
from ._sampling import choose


@dataclasses.dataclass
class Request:
    """One request: its prompt tokens, the tokens generated so far, its cache blocks.
    Under beam search its beams hold the blocks (``engine.beam``), and ``generated`` is
    its best hypothesis once it is done."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0             # tokens whose keys and values are in the cache
    done: bool = False
    pending: int = 0            # tokens launched on the GPU and not read yet (graphs)
    dropped: int = 0            # blocks evicted by StreamingLLM's window
    row: int = -1               # its row in the latest launched step


class InferenceEngine:
    """Serve ``model`` (a transformers causal LM, single-process or parallelized by
    meshlab with ``shard``, ``zero_shard`` or ``lora``; or a local Hugging Face directory,
    loaded with its tokenizer by :func:`load_pretrained`) with ``inference_config``.

    ``tokenizer`` turns string prompts into tokens and back; without it prompts are lists
    of token ids and so are the outputs. An unparallelized model with ``tp_size > 1`` is
    parallelized here with ``shard(model_policy or policies.auto)`` over ``Mesh(tp=...)``
    (the process group must be started). The model is cast to ``dtype`` and put in eval
    mode; its attention is routed to the paged cache.
    """

    def __init__(self, model: nn.Module, tokenizer=None,
                 inference_config: InferenceConfig | None = None, verbose: bool = False,
                 model_policy=None, drafter_model: nn.Module | None = None):
        cfg = inference_config if inference_config is not None else InferenceConfig()
        if not isinstance(cfg, InferenceConfig):
            raise ConfigTypeError(f"InferenceEngine(inference_config=...): an InferenceConfig, "
                                  f"got {type(cfg).__name__}")
        if isinstance(model, (str, os.PathLike)):
            model, found = load_pretrained(os.fspath(model), cfg.dtype)
            tokenizer = found if tokenizer is None else tokenizer
        self.config, self.tokenizer, self.verbose = cfg, tokenizer, verbose
        self.model = _prepare(model, cfg, model_policy)
        check_vocab(cfg, self.model.config.vocab_size)
        self.agreement = StepAgreement(self.model)
        self.pipe = _pipeline_decoder(self.model)
        if cfg.micro_batch_size > 1 and self.pipe is None:
            raise ConfigError(f"InferenceConfig(micro_batch_size={cfg.micro_batch_size}) on a "
                              f"model that is not pipelined: micro-batches overlap pipeline "
                              f"stages; parallelize the model with pipeline(), or leave "
                              f"micro_batch_size=1")
        self.eos = set() if cfg.ignore_eos else eos_ids(self.model, tokenizer)
        unread_generation_config(self.model, cfg)
        self.device = next(p for p in self.model.parameters()).device
        self.spec = None                     # the drafter, under speculative decoding
        self.window = window_blocks(cfg)     # blocks a decoding request holds (StreamingLLM)
        self.beam = _beam_search(self, cfg)  # the beams of each request, under beam search
        self._size_cache(0)
        self.graphs = _graphs(self, cfg, model)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.inflight = None                 # a greedy decode step launched, not read
        self.launch_ahead = True             # False: read each graph step before the next
        self.past_eos = 0                    # tokens computed past a request's EOS (graphs)
        self._next = 0
        self.steps = 0
        self.last_batch: list[int] = []      # the request ids the last step ran
        if cfg.use_spec_dec:
            if drafter_model is None:
                raise ConfigError("InferenceConfig(use_spec_dec=True): give the draft model, "
                                  "InferenceEngine(model, tokenizer, config, drafter_model=...) "
                                  "or engine.enable_spec_dec(drafter_model)")
            self.enable_spec_dec(drafter_model)
        elif drafter_model is not None:
            raise ConfigError("InferenceEngine(drafter_model=...) with use_spec_dec=False: set "
                              "InferenceConfig(use_spec_dec=True) to decode speculatively")

    def __repr__(self) -> str:
        """What the engine runs, in a few lines: the model and cache, how decode steps run
        (graphs, kernels and what they routed, speculation), and the queue."""
        cfg, m = self.config, self.model
        dtype = str(cfg.dtype).removeprefix("torch.")
        lines = [f"InferenceEngine({type(m).__name__}, {dtype} on {self.device}, "
                 f"max_batch_size={cfg.max_batch_size}",
                 f"  paged cache: {self.cache.num_blocks} blocks of {cfg.block_size} tokens"]
        rt = runtime_or_none(m)
        if rt is not None:
            lines.append(f"  parallelized over {mesh_repr(rt.plan.mesh_shape)}"
                         + (", pipelined: stages in turn" if self.pipe is not None else ""))
        if self.graphs is not None:
            lines.append(f"  decode steps as CUDA graphs, batch buckets "
                         f"{self.graphs.buckets}")
        kernels, merged = getattr(m, "_meshlab_kernels", None), merged_of(m)
        if kernels is not None:
            lines.append(f"  meshlab kernels: {kernels.counts()}")
        if merged is not None:
            lines.append(f"  merged products: {merged.counts()}")
            lines += [f"  not fused: {k}: {v}" for k, v in merged.unfused.items()]
        if self.spec is not None:
            lines.append(f"  speculative decoding: {self.spec.k} drafted tokens a "
                         f"step, {self.spec.accepted} of {self.spec.proposed} kept so far")
        lines.append(f"  requests: {len(self.waiting)} waiting, {len(self.running)} running, "
                     f"{self.steps} steps run)")
        return "\n".join(lines)

    def _size_cache(self, ahead: int) -> None:
        """A cache for ``max_batch_size`` sequences (requests, or beams under beam
        search), each holding what ``_need`` says with ``ahead`` tokens more (a
        verification's drafted tokens)."""
        cfg = self.config
        per_request = self._need(cfg.max_input_len, cfg.max_output_len + ahead)
        n = cfg.max_batch_size * per_request
        # one more block: the scratch that a decode graph's padded rows write to
        self.cache = PagedCache(n + 1, cfg.block_size, cfg.kv_cache_dtype)
        self.blocks = Blocks(n)
        self.ahead = ahead

    def _need(self, prompt: int, new: int) -> int:
        """The blocks a request of ``prompt`` tokens making ``new`` more holds: its whole
        budget, or under StreamingLLM at most its prompt's or the window's."""
        bs, window = self.config.block_size, self.window
        need = math.ceil((prompt + new) / bs)
        return need if window is None else min(need, max(math.ceil(prompt / bs), window))

    # ------------------------------------------------------------------ speculation

    def enable_spec_dec(self, drafter_model: nn.Module, n_spec_tokens: int | None = None):
        """Decode speculatively: ``drafter_model`` (a smaller causal LM with the same
        vocabulary) proposes ``n_spec_tokens`` (default ``max_n_spec_tokens``) tokens per
        step greedily, the model checks them in one pass and keeps the longest run it
        agrees with plus its own next token: the same tokens as greedy decoding alone."""
        from ._speculate import Speculator, draft_config, spec_tokens

        if self.has_work():
            raise ConfigError("enable_spec_dec: requests are in flight; call it between "
                              "generate() calls")
        k = spec_tokens(self, drafter_model, n_spec_tokens)
        self.spec = Speculator(InferenceEngine(drafter_model, None,
                                               draft_config(self.config, k)), k)
        self._size_cache(k)

    def disable_spec_dec(self) -> None:
        """Back to one token per step from the model alone."""
        if self.has_work():
            raise ConfigError("disable_spec_dec: requests are in flight; call it between "
                              "generate() calls")
        self.spec = None
        self._size_cache(0)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, max_new_tokens: int | None = None) -> int:
        """Queue ``prompt`` (a string with a tokenizer, else a list of token ids); returns
        its request id."""
        tokens = self._tokens(prompt)
        n = self.config.max_output_len if max_new_tokens is None else max_new_tokens
        if not isinstance(n, int) or n < 1 or n > self.config.max_output_len:
            raise ConfigError(f"add_request(max_new_tokens={n!r}): between 1 and "
                              f"max_output_len={self.config.max_output_len}")
        r = Request(self._next, tokens, n)
        self._next += 1
        self.waiting.append(r)
        self.agreement.added(r)
        return r.rid

    def _tokens(self, prompt) -> list[int]:
        template = self.config.prompt_template
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a string prompt needs InferenceEngine(model, tokenizer); "
                                  "or give the prompt as a list of token ids")
            prompt = _templated(self.tokenizer, template, prompt)
        elif template is not None:
            raise ConfigError(f"InferenceConfig(prompt_template={template!r}) applies to "
                              f"string prompts; this one is token ids: give the text, or "
                              f"apply the template before tokenizing")
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1) or \
                    prompt.is_floating_point() or prompt.dtype == torch.bool:
                raise ConfigError(
                    f"a prompt is one sequence of token ids: a 1-d integer tensor (or one "
                    f"row, (1, S)); got a {prompt.dtype} tensor of shape {tuple(prompt.shape)}. "
                    f"Queue each row with its own add_request, or pass the rows to "
                    f"generate(prompts=...), which takes a batch")
            prompt = prompt.flatten().tolist()
        if not all(isinstance(t, int) or (hasattr(t, "__index__") and not isinstance(t, bool))
                   for t in prompt):
            raise ConfigError(f"a prompt is one sequence of token ids (ints); got "
                              f"{type(prompt).__name__} holding "
                              f"{sorted({type(t).__name__ for t in prompt})}: queue each "
                              f"sequence with its own add_request")
        tokens = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not tokens or len(tokens) > self.config.max_input_len:
            raise ConfigError(f"a prompt of {len(tokens)} tokens: between 1 and "
                              f"max_input_len={self.config.max_input_len}")
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ConfigError(f"prompt token ids must be in [0, {vocab}); got "
                              f"{min(tokens)}..{max(tokens)}")
        return tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight is not None)

    # ------------------------------------------------------------------ steps

    def _admit(self) -> None:
        w = self.config.beam_width                                 # w sequences a request
        while self.waiting and (len(self.running) + 1) * w <= self.config.max_batch_size:
            r = self.waiting[0]
            need = self._need(len(r.prompt), r.max_new_tokens + self.ahead)
            if need * w > len(self.blocks.free):
                break
            r.blocks = self.blocks.take(need)
            if self.spec is not None:
                self.spec.admit(r, need)
            if self.beam is not None:
                self.beam.admit(r, need)
            self.running.append(self.waiting.pop(0))

    def _batch(self, seqs=None) -> tuple[list[int], list[int], PagedBatch]:
        """The packed row of ``seqs`` (default: the running requests; beams under beam
        search), each sequence's tokens not in the cache yet."""
        bs = self.config.block_size
        seqs = self.running if seqs is None else seqs
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for r in seqs:
            new = (r.prompt + r.generated)[r.cached:]    # the tokens not in the cache yet
            for i, t in enumerate(new):
                p = r.cached + i
                ids.append(t)
                pos.append(p)
                slots.append(place(r, p, bs, self.window))
            starts.append(starts[-1] + len(new))
            lens.append(r.cached + len(new) - r.dropped * bs)     # the keys it keeps
        width = max(len(r.blocks) for r in seqs)
        tables = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in seqs],
                              dtype=torch.int32, device=self.device)
        batch = PagedBatch(self.cache, torch.tensor(slots, device=self.device), tables, lens,
                           starts, layout(tables, lens, starts, bs))
        return ids, pos, batch

    @agreed_step
    def step(self) -> list[Request]:
        """Admit, run the model once on every running request, choose their next tokens;
        returns the requests that finished in this step (the ranks agree first, ``_agree``)."""
        self._admit()
        if self._ahead():
            return self._launch_and_read()
        if self.inflight is not None:       # read it first: the next step runs eagerly
            return self._read()
        if not self.running:
            if self.waiting:
                raise ConfigError("the paged cache cannot hold the next request's budget; "
                                  "lower its max_new_tokens or raise max_batch_size")
            return []
        self.last_batch = [r.rid for r in self.running]
        verify = self.spec is not None and all(r.cached for r in self.running)
        if self.beam is not None or verify:         # beam search, or a speculative step
            finished = (self.beam or self.spec).step(self)
            self.steps += 1
            return finished
        best = None
        if self.graphs is not None and all(r.cached for r in self.running):
            (logits, best), lens = self.graphs.logits(self.running), \
                [r.cached + 1 for r in self.running]
        else:
            logits, lens = self._eager()
        nxt = self._choose(logits, best)
        if self.pipe is not None:           # the last stage chose; every rank appends it
            nxt = self.pipe.share(nxt, len(self.running), self.device)
        for r, t, n in zip(self.running, nxt, lens):
            r.cached = n
            r.generated.append(t)
        self.steps += 1
        return self._retire()

    def _ahead(self) -> bool:
        """Whether this step is a greedy decode step of graphs launched ahead of the
        host (``_graphs``): every running request decoding, no token processor."""
        cfg = self.config
        return (self.graphs is not None and self.launch_ahead and self.beam is None
                and self.spec is None
                and not cfg.do_sample and cfg.repetition_penalty in (None, 1.0)
                and not cfg.no_repeat_ngram_size and bool(self.running)
                and all(r.cached for r in self.running))

    def _launch_and_read(self) -> list[Request]:
        """Launch this step on the requests with budget left (their tokens of the step in
        flight come from the device), then read the step in flight and retire."""
        go = [r for r in self.running if len(r.generated) + r.pending < r.max_new_tokens]
        prev, self.inflight = self.inflight, None
        if go:
            self.inflight = self.graphs.launch(go)
            self.last_batch = [r.rid for r in go]
            self.steps += 1
        return self._read(prev) if prev is not None else []

    def _read(self, step=None) -> list[Request]:
        """Wait for a launched step (default: the one in flight), append its tokens and
        retire; a request that ended at an earlier step drops its token."""
        if step is None:
            step, self.inflight = self.inflight, None
        forced = self.config.forced_eos_token_id
        for r, t in zip(step.reqs, self.graphs.read(step)):
            if r.done:
                self.past_eos += 1
                continue
            if forced is not None and len(r.generated) + 1 == r.max_new_tokens:
                t = forced
            r.generated.append(t)
        finished = self._retire()
        if self.inflight is not None and all(r.done for r in self.inflight.reqs):
            self.graphs.read(self.inflight)         # nothing of it is kept
            self.past_eos += len(self.inflight.reqs)
            self.inflight = None
        return finished

    def _retire(self) -> list[Request]:
        """Requests that emitted EOS or reached their budget leave and free their blocks."""
        finished = []
        for r in self.running:
            if r.generated and (r.generated[-1] in self.eos or
                                len(r.generated) >= r.max_new_tokens):
                r.done = True
                self.blocks.give(r.blocks)
                r.blocks = []
                if self.spec is not None:
                    self.spec.release(r)
                finished.append(r)
        self.running = [r for r in self.running if not r.done]
        return finished

    def _eager(self, every_position: bool = False, seqs=None):
        """The step's logits (None on a pipeline rank without the last stage) and each
        request's (or each of ``seqs``') tokens cached after it, the model run eagerly on
        the packed tokens: at each request's last position, or ``every_position`` of the
        packed row.
        A pipelined model with ``micro_batch_size`` k > 1 runs micro-batches of k requests
        through its stages (``_pipeline``); the logits come back in the requests' order."""
        from ..transforms.shard._styles import whole_logits

        seqs = self.running if seqs is None else seqs
        k = self.config.micro_batch_size
        k = k if self.pipe is not None and k > 1 else len(seqs)
        micro = [self._packed(seqs[i:i + k], every_position) for i in range(0, len(seqs), k)]
        with torch.no_grad(), whole_logits():
            if self.pipe is not None:
                logits = self.pipe.logits(micro, self.config.dtype,
                                          self.config.micro_batch_buffer_size)
            else:
                ids_t, pos_t, last, batch = micro[0]
                with running(batch):
                    logits = self.model(input_ids=ids_t, position_ids=pos_t, use_cache=False,
                                        logits_to_keep=last).logits[0]
        return logits, [len(r.prompt) + len(r.generated) for r in seqs]   # all now cached

    def _packed(self, seqs, every_position: bool):
        """``seqs`` packed in one row as the model takes them: ids and positions (1, T),
        the positions whose logits are kept, and their ``PagedBatch``."""
        ids, pos, batch = self._batch(seqs)
        dev = self.device
        last = torch.arange(len(ids), device=dev) if every_position else \
            torch.tensor(batch.query_start[1:], device=dev) - 1
        return (torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), last,
                batch)

    def _choose(self, logits, best=None) -> list[int] | None:
        if logits is None:                  # a pipeline rank without the last stage
            return None
        forced = self.config.forced_eos_token_id
        return choose(logits, [r.prompt + r.generated for r in self.running],
                      [forced if forced is not None and len(r.generated) + 1 == r.max_new_tokens
                       else None for r in self.running], self.config, self.gen, best)

    def generate(self, prompts=None, request_ids=None, max_new_tokens: int | None = None):
        """Generate for every prompt (continuous batching when there are more than
        ``max_batch_size``); returns the generated tokens of each (strings with a
        tokenizer and string prompts), in the prompts' order. ``request_ids`` names them
        (default 0..n-1) for the progress bar only."""
        if prompts is None or isinstance(prompts, str) or not len(prompts):
            raise ConfigError("generate(prompts=[...]): a non-empty list of prompts (strings "
                              "or lists of token ids)")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ConfigError(f"generate: {len(request_ids)} request_ids for {len(prompts)} "
                              f"prompts")
        rids = [self.add_request(p, max_new_tokens) for p in prompts]
        done: dict[int, list[int]] = {}
        bar = _progress(len(rids), self.verbose)
        while len(done) < len(rids):
            for r in self.step():
                done[r.rid] = r.generated
                bar.update(1)
        bar.close()
        outs = [done[i] for i in rids]
        if self.tokenizer is not None and isinstance(prompts[0], str):
            return [self.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        return outs


def _templated(tokenizer, template: str | None, text: str) -> list[int]:
    """The token ids of ``text`` under ``prompt_template``."""
    from ._config import CHAT

    if template is None:
        return tokenizer(text)["input_ids"]
    if template != CHAT:
        return tokenizer(template.format(input_text=text))["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("InferenceConfig(prompt_template='chat'): the tokenizer has no "
                          "chat_template; give a format string with {input_text} instead")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _progress(total: int, verbose: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not verbose)


def _prepare(model: nn.Module, cfg: InferenceConfig, policy) -> nn.Module:
    """The model as the engine runs it: parallelized as asked, refusals typed, in
    ``cfg.dtype``, eval mode, attention on the paged cache."""
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise ConfigError(f"InferenceEngine: {type(model).__name__} is not a transformers "
                          f"model (set_attn_implementation); the engine routes its attention "
                          f"to the paged cache through transformers' AttentionInterface")
    rt = runtime_or_none(model)
    if rt is None and cfg.tp_size > 1:
        model = _parallelize(model, cfg.tp_size, policy)
        rt = runtime_of(model)
    if rt is not None:
        _check_plan(rt, cfg)
    if any(p.is_floating_point() and p.dtype != cfg.dtype for p in model.parameters()):
        model.to(cfg.dtype)
    model.eval()
    model.set_attn_implementation(register())
    if cfg.use_cuda_kernel:
        _fuse_kernels(model, rt, cfg)
    return model


# What ``use_cuda_kernel`` routes: the ops of a decoder layer besides its attention (which
# is the paged op already) and its projections (cuBLAS).
KERNEL_OPS = ("rms_norm", "rotary", "mlp")


def _fuse_kernels(model: nn.Module, rt, cfg: InferenceConfig) -> None:
    """``use_cuda_kernel=True``: route the model's RMSNorm, rotary embedding and gated MLP
    to meshlab's fused ops (Triton on CUDA, C++ on the CPU), each routing probed first;
    the ops this model has none of are skipped (``model._meshlab_kernels`` says which
    were routed), none at all is refused; merge each layer's query/key/value and
    gate/up projections into one product each (``_merge``, ``merged_of(model)``);
    and let the rotary embedding look its angles up in a table of every position a
    request can reach (``_merge.table_rotary``)."""
    from ..transforms.fuse import fuse_model, refusals
    from ._merge import merge_projections, table_rotary

    if rt is not None:
        raise ConfigError("InferenceConfig(use_cuda_kernel=True) is built for a model of one "
                          "process; with tp_size or a parallelized model leave it False (or "
                          "parallelize with ml.fuse(), which routes the same ops under the "
                          "plan)")
    refused = refusals(model, KERNEL_OPS)
    ops = [op for op in KERNEL_OPS if op not in refused]
    if not ops:
        raise ConfigError(f"InferenceConfig(use_cuda_kernel=True): {type(model).__name__} "
                          f"has nothing meshlab's kernels route: " +
                          "; ".join(f"{op}: {why}" for op, why in refused.items()))
    model._meshlab_kernels = fuse_model(model, ops)
    merged = merge_projections(model)
    positions = cfg.max_input_len + cfg.max_output_len + cfg.max_n_spec_tokens + 1
    merged.tables = table_rotary(model, positions, cfg.dtype)


def _beam_search(engine, cfg: InferenceConfig):
    """The engine's beam searches (``_beam``), when ``beam_width`` is above 1."""
    if cfg.beam_width == 1:
        return None
    from ._beam import BeamSearch

    return BeamSearch(engine)


def _graphs(engine, cfg: InferenceConfig, model: nn.Module):
    """The engine's captured decode steps, when asked for and possible."""
    if not cfg.use_cuda_graph:
        return None
    if engine.device.type != "cuda":
        raise ConfigError(f"InferenceConfig(use_cuda_graph=True): the model is on "
                          f"{engine.device}; CUDA graphs need it on a GPU")
    if runtime_or_none(model) is not None:
        raise ConfigError("InferenceConfig(use_cuda_graph=True) on a parallelized model: "
                          "decode graphs are built for a model on one GPU; leave "
                          "use_cuda_graph off under tp, zero_shard or pipeline")
    context = cfg.max_input_len + cfg.max_output_len
    if context > cfg.max_context_len_to_capture:
        raise ConfigError(f"InferenceConfig(use_cuda_graph=True): max_input_len + "
                          f"max_output_len = {context} exceeds max_context_len_to_capture="
                          f"{cfg.max_context_len_to_capture}; raise it or shorten the budget")
    from ._graphs import DecodeGraphs

    return DecodeGraphs(engine)


def _pipeline_decoder(model: nn.Module):
    """The stages of a pipelined model as the engine runs them, or None."""
    rt = runtime_or_none(model)
    if rt is None:
        return None
    from ..transforms.pipeline._runtime import PipelinePart
    from ._pipeline import PipelineDecoder

    part = rt.part(PipelinePart)
    return None if part is None else PipelineDecoder(model, rt, part)


def _parallelize(model: nn.Module, tp: int, policy) -> nn.Module:
    from ..apply.parallelize import parallelize
    from ..core.mesh import Mesh
    from ..core.rules import Rules
    from ..policies import auto
    from ..transforms.shard import shard

    rules = Rules(heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)
    return parallelize(model, shard(policy or auto, rules), Mesh(tp=tp))


def _check_plan(rt, cfg: InferenceConfig) -> None:
    from ..transforms.sequence import Sequence
    from ..transforms.shard._layout import sequence_parallel

    plan = rt.plan          # pp_size other than 1 is refused by InferenceConfig itself
    tp = plan.roles.tp
    if plan.get(Sequence) is not None or (tp is not None and sequence_parallel(plan, tp)):
        raise ConfigError("InferenceEngine under sequence parallelism: a decoding step's one "
                          "token cannot be split over the sequence; serve the weights with a "
                          "plan without sequence()/sequence_parallel")
    size = plan.mesh_shape[tp] if tp else 1
    if cfg.tp_size not in (1, size):
        raise ConfigError(f"InferenceConfig(tp_size={cfg.tp_size}) but the model is already "
                          f"parallelized with tp={size}; leave tp_size at 1 or set it to {size}")
