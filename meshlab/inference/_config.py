"""``InferenceConfig``: the engine's options, with Colossal-AI's field names and defaults.

Every field of Colossal-AI's ``InferenceConfig`` is here with its default. The engine
implements ``prompt_template`` (a format string with ``{input_text}``, or ``"chat"``:
the tokenizer's chat template with the prompt as one user message, applied to string
prompts), StreamingLLM (``enable_streamingllm``: the first block and a window of whole
blocks of at least ``generated_token_size`` tokens, ``_paged.place``), greedy decoding and
sampling (``do_sample``, ``temperature``, ``top_k``,
``top_p``, ``repetition_penalty``, ``no_repeat_ngram_size``), ``forced_eos_token_id``,
``ignore_eos``, beam search (``beam_width``, ``early_stopping``: transformers'
``num_beams`` with ``length_penalty=1.0``; ``max_batch_size`` then counts beams), the
paged cache (``block_size``, ``kv_cache_dtype``), continuous batching up to
``max_batch_size``, ``dtype``, ``tp_size``, ``use_cuda_kernel`` (the model's RMSNorm,
rotary embedding and gated MLP on meshlab's fused ops, on a model of one process), CUDA graphs of decode steps on one GPU
(``use_cuda_graph``, ``max_context_len_to_capture``), greedy speculative decoding with a
draft model (``use_spec_dec``, ``max_n_spec_tokens``), and on a pipelined model
micro-batches of ``micro_batch_size`` requests that overlap across the stages (above 1:
a model that is not pipelined, speculation and beam search refuse it), at most
``micro_batch_buffer_size`` of them sent on by a rank and not yet delivered (None: no
bound; it needs micro_batch_size above 1). A field set to
anything but its default whose behaviour is not built raises ``ConfigError`` naming it, at
construction: nothing is accepted and ignored.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.errors import ConfigError

# field -> why a value other than the default is refused
_NOT_BUILT = {
    "prefill_ratio": "prefill is not rationed: every admitted prompt is filled in its step",
    "pad_input": "requests are packed, never padded",
    "glimpse_large_kv": "the large-KV glimpse is not built",
    "pp_size": "the engine pipelines a model parallelized with pipeline() (pp_size is read "
               "from it); give it that model",
    "high_precision": "scores and softmax already run in float32 (float64 for float64)",
    "patched_parallelism_size": "patched parallelism is for diffusion pipelines",
}


@dataclasses.dataclass
class InferenceConfig:
    """Options of :class:`~meshlab.inference.InferenceEngine` (module docstring)."""

    max_batch_size: int = 8
    max_input_len: int = 256
    max_output_len: int = 256
    dtype: torch.dtype | str = torch.float16
    kv_cache_dtype: torch.dtype | str | None = None
    prompt_template: str | None = None
    do_sample: bool = False
    beam_width: int = 1
    prefill_ratio: float = 1.2
    pad_input: bool = False
    early_stopping: bool | str = False
    top_k: int | None = 50
    top_p: float | None = 1.0
    temperature: float | None = 1.0
    no_repeat_ngram_size: int | None = 0
    repetition_penalty: float | None = 1.0
    forced_eos_token_id: int | None = None
    ignore_eos: bool = False
    use_spec_dec: bool = False
    max_n_spec_tokens: int = 5
    glimpse_large_kv: bool = False
    block_size: int = 16
    tp_size: int = 1
    pp_size: int = 1
    micro_batch_size: int = 1
    micro_batch_buffer_size: int | None = None
    use_cuda_kernel: bool = False
    high_precision: bool = False
    use_cuda_graph: bool = False
    max_context_len_to_capture: int = 512
    enable_streamingllm: bool = False
    start_token_size: int = 4
    generated_token_size: int = 512
    patched_parallelism_size: int = 1
    # meshlab's own: the seed of the sampling generator (the same on every rank)
    seed: int = 0

    def __post_init__(self):
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, why in _NOT_BUILT.items():
            if not _is_default(getattr(self, name), defaults[name]):
                raise ConfigError(f"InferenceConfig({name}={getattr(self, name)!r}): {why}; "
                                  f"leave {name} at its default {defaults[name]!r}")
        self.dtype = _dtype(self.dtype, "dtype")
        if self.kv_cache_dtype is not None:
            self.kv_cache_dtype = _dtype(self.kv_cache_dtype, "kv_cache_dtype")
        _check_fields(self)
        _check_beams(self)
        _check_micro(self)
        _check_template(self.prompt_template)
        _check_streaming(self)


_FLAGS = ("do_sample", "ignore_eos", "use_spec_dec", "use_cuda_kernel", "use_cuda_graph",
          "enable_streamingllm")
_COUNTS = ("max_batch_size", "max_input_len", "max_output_len", "block_size", "tp_size",
           "max_n_spec_tokens", "micro_batch_size", "max_context_len_to_capture",
           "start_token_size", "generated_token_size")


def _is_default(value, default) -> bool:
    """``value`` is the field's default (of its type: ``True`` is not ``1``)."""
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default)
    except (TypeError, ValueError, RuntimeError):     # an array's elementwise ==
        return False


def _check_fields(cfg: "InferenceConfig") -> None:
    """Each field's type and range, where it is given: a NaN temperature or a negative
    top_k would otherwise be accepted here and fail (or sample wrongly) at the first step."""
    from ..core.errors import check_bool, check_int, check_number

    call = "InferenceConfig"
    for name in _FLAGS:
        check_bool(getattr(cfg, name), call, name)
    for name in _COUNTS:
        check_int(getattr(cfg, name), call, name)
    check_int(cfg.seed, call, "seed", low=0, example=0)
    for name, example in (("top_k", 50), ("no_repeat_ngram_size", 0)):
        if getattr(cfg, name) is not None:       # 0 or None: off
            check_int(getattr(cfg, name), call, name, low=0, example=example)
    if cfg.forced_eos_token_id is not None:
        check_int(cfg.forced_eos_token_id, call, "forced_eos_token_id", low=0, example=2)
    if cfg.temperature is not None:
        if cfg.temperature == 0 and not isinstance(cfg.temperature, bool):
            raise ConfigError("InferenceConfig(temperature=0): must be > 0; for greedy "
                              "decoding set do_sample=False")
        check_number(cfg.temperature, call, "temperature", example=0.7)
    if cfg.repetition_penalty is not None:
        check_number(cfg.repetition_penalty, call, "repetition_penalty", example=1.0)
    if cfg.top_p is not None:
        p = check_number(cfg.top_p, call, "top_p", example=0.9)
        if p > 1:
            raise ConfigError(f"InferenceConfig(top_p={cfg.top_p!r}): top_p is a "
                              f"probability in (0, 1] (1.0: off); pass e.g. top_p=0.9")


def check_vocab(cfg: InferenceConfig, vocab: int) -> None:
    """The configuration's token ids inside the model's vocabulary of ``vocab``: a forced
    EOS is emitted as it is, so an id outside it would come back as a token the model has
    no row for."""
    t = cfg.forced_eos_token_id
    if t is None:
        return
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
        raise ConfigError(f"InferenceConfig(forced_eos_token_id={t!r}): a token id of this "
                          f"model's vocabulary, 0..{vocab - 1} (config.vocab_size={vocab}); "
                          f"give the tokenizer's eos_token_id, or None")


def _check_streaming(cfg: InferenceConfig) -> None:
    """StreamingLLM: the first block (the attention sinks) and whole blocks of at least the
    last ``generated_token_size`` tokens; beam search and speculation refuse it."""
    if not cfg.enable_streamingllm:
        return
    s, g, bs = cfg.start_token_size, cfg.generated_token_size, cfg.block_size
    if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= bs:
        raise ConfigError(f"InferenceConfig(start_token_size={s!r}): between 1 and block_size="
                          f"{bs}; the whole first block is kept as the attention sinks")
    if not isinstance(g, int) or isinstance(g, bool) or g < bs or g % bs:
        raise ConfigError(f"InferenceConfig(generated_token_size={g!r}): a positive multiple "
                          f"of block_size={bs}; the window is kept in whole blocks")
    for name, plain in (("beam_width", 1), ("use_spec_dec", False)):
        if getattr(cfg, name) != plain:
            raise ConfigError(f"InferenceConfig(enable_streamingllm=True, {name}="
                              f"{getattr(cfg, name)!r}): the sliding window is built for "
                              f"one sequence a request decoding a token a step; set "
                              f"{name}={plain!r} or enable_streamingllm=False")


def window_blocks(cfg: InferenceConfig) -> int | None:
    """The blocks a request holds once decoding under StreamingLLM (the first, the window
    and the block being filled), or None without it."""
    return cfg.generated_token_size // cfg.block_size + 2 if cfg.enable_streamingllm else None


CHAT = "chat"       # prompt_template: the tokenizer's own chat template


def _check_template(t) -> None:
    """``prompt_template``: None, ``"chat"``, or a format string with ``{input_text}``."""
    if t is None or t == CHAT:
        return
    fix = ("give a format string with {input_text} (e.g. '[INST] {input_text} [/INST]'), "
           "or 'chat' for the tokenizer's chat template")
    if not isinstance(t, str) or "{input_text}" not in t:
        raise ConfigError(f"InferenceConfig(prompt_template={t!r}): {fix}; Colossal-AI's "
                          f"template names are not built in")
    try:
        t.format(input_text="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"InferenceConfig(prompt_template={t!r}) does not format with "
                          f"input_text alone ({type(e).__name__}: {e}); double any other "
                          f"braces ({{{{ and }}}})") from e


def _check_micro(cfg: InferenceConfig) -> None:
    """Micro-batches split the one packed step that greedy decoding and sampling run;
    speculative checks and beam search run steps of their own, refused with them."""
    k = cfg.micro_batch_size
    buf = cfg.micro_batch_buffer_size
    if buf is not None:
        if not isinstance(buf, int) or isinstance(buf, bool) or buf < 1:
            raise ConfigError(f"InferenceConfig(micro_batch_buffer_size={buf!r}): a positive "
                              f"integer, or None for no bound")
        if k == 1:
            raise ConfigError(f"InferenceConfig(micro_batch_buffer_size={buf}) bounds the "
                              f"micro-batches in flight between pipeline stages, and "
                              f"micro_batch_size=1 runs one batch per step; set "
                              f"micro_batch_size above 1 or leave the buffer at None")
    for name, plain in (("use_spec_dec", False), ("beam_width", 1)):
        value = getattr(cfg, name)
        if k > 1 and value != plain:
            raise ConfigError(f"InferenceConfig(micro_batch_size={k}, {name}={value!r}): "
                              f"pipeline micro-batches split greedy and sampled steps only; "
                              f"set micro_batch_size=1 or {name}={plain!r}")


# field -> its values that beam search runs with (it scores plain log-probabilities)
_BEAM_PLAIN = (("do_sample", (False,)), ("use_spec_dec", (False,)),
               ("use_cuda_graph", (False,)), ("repetition_penalty", (1.0, None)),
               ("no_repeat_ngram_size", (0, None)), ("forced_eos_token_id", (None,)))


def _check_beams(cfg: InferenceConfig) -> None:
    """``beam_width`` and ``early_stopping``, and the fields beam search refuses."""
    w = cfg.beam_width
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise ConfigError(f"InferenceConfig(beam_width={w!r}): a positive integer (1: no beam "
                          f"search)")
    if not isinstance(cfg.early_stopping, bool) and cfg.early_stopping != "never":
        raise ConfigError(f"InferenceConfig(early_stopping={cfg.early_stopping!r}): True, "
                          f"False or 'never', as in transformers")
    if w == 1:
        if cfg.early_stopping is not False:
            raise ConfigError(f"InferenceConfig(early_stopping={cfg.early_stopping!r}) with "
                              f"beam_width=1: early stopping is of beam search only; set "
                              f"beam_width above 1 or leave early_stopping=False")
        return
    for name, plain in _BEAM_PLAIN:
        value = getattr(cfg, name)
        if value not in plain:
            raise ConfigError(f"InferenceConfig(beam_width={w}, {name}={value!r}): beam search "
                              f"here is transformers' generate(num_beams=...) without sampling "
                              f"or logit processors; set {name}={plain[0]!r} or beam_width=1")
    if cfg.max_batch_size < w:
        raise ConfigError(f"InferenceConfig(beam_width={w}, max_batch_size={cfg.max_batch_size})"
                          f": max_batch_size counts beams (a request runs beam_width of them) "
                          f"and the cache holds max_batch_size beams' budgets; raise "
                          f"max_batch_size to at least {w}")


_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp64": torch.float64, "float64": torch.float64}


def _dtype(v, name: str) -> torch.dtype:
    if isinstance(v, torch.dtype) and v.is_floating_point:
        return v
    if isinstance(v, str) and v in _DTYPES:
        return _DTYPES[v]
    raise ConfigError(f"InferenceConfig({name}={v!r}): a floating torch.dtype or one of "
                      f"{sorted(_DTYPES)}")
