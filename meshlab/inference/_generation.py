"""What the engine reads of a model's ``generation_config``: the EOS ids, and the decoding
settings ``model.generate()`` would apply and the engine does not (it decodes as its
``InferenceConfig`` says), named in a warning."""

from __future__ import annotations

from torch import nn

from ._config import InferenceConfig


def eos_ids(model: nn.Module, tokenizer) -> set[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])


# The decoding settings of a model's generation_config that model.generate() reads and
# the engine takes from its InferenceConfig instead (the config's field of the same name):
# each with transformers' default, at which the two decode alike.
_DECODING = (("do_sample", False), ("temperature", 1.0), ("top_k", 50), ("top_p", 1.0),
             ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0))
_UNREAD = (("max_new_tokens", None, "give max_new_tokens to generate() or add_request"),
           ("min_new_tokens", None, "the engine has no minimum length"),
           ("min_length", 0, "the engine has no minimum length"),
           ("num_beams", 1, "beam search is InferenceConfig(beam_width=...)"))


def unread_generation_config(model: nn.Module, cfg: InferenceConfig) -> None:
    """Warn, naming each, about the decoding settings of ``model.generation_config`` that
    ``model.generate()`` would apply and the engine does not: it decodes as its
    ``InferenceConfig`` says (Colossal-AI's engine does too) and reads only the EOS ids
    there, so its tokens would differ from ``generate()``'s without a word."""
    import warnings

    gc = getattr(model, "generation_config", None)
    if gc is None:
        return
    differ = [f"{name}={getattr(gc, name)!r}" for name, default in _DECODING
              if getattr(gc, name, default) not in (default, None)
              and getattr(gc, name) != getattr(cfg, name)]
    unread = [(f"{name}={getattr(gc, name)!r}", fix) for name, default, fix in _UNREAD
              if getattr(gc, name, default) not in (default, None)]
    if not differ and not unread:
        return
    fixes = ([f"pass InferenceConfig({', '.join(differ)}) to decode as generate() does"]
             if differ else []) + list(dict.fromkeys(fix for _, fix in unread))
    warnings.warn(
        f"InferenceEngine: {type(model).__name__}.generation_config sets "
        f"{', '.join(differ + [n for n, _ in unread])}, which model.generate() applies and "
        f"the engine does not read (it decodes as its InferenceConfig says): "
        f"{'; '.join(fixes)}", UserWarning, stacklevel=3)
