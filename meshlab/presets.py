"""Named model shapes (Hugging Face configs) to plan and train without downloading.

>>> sorted(PRESETS)[:3]
['gpt2-small', 'llama3-405b', 'llama3-70b']
"""

from __future__ import annotations

from typing import Any

from ._errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False),
    "llama3-405b": dict(model_type="llama", hidden_size=16384, intermediate_size=53248,
                        num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                        tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=32000, tie_word_embeddings=False),
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     vocab_size=152064, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                         tie_word_embeddings=False),
    "gpt2-small": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257),
    # The demo model: small enough to train on CPU processes in a minute.
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False),
}


def config(name_or_path: str, **overrides: Any):
    """A ``transformers`` config from a preset name or a local ``config.json`` path."""
    import os

    from transformers import AutoConfig

    if os.path.exists(name_or_path):
        path = name_or_path
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return cfg
    if name_or_path not in PRESETS:
        raise ConfigError(
            f"model {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            f"path to a config.json"
        )
    kw = {**PRESETS[name_or_path], **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


# The auto classes tried, in order, for a config without a known ``architectures`` entry.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                "AutoModelForSpeechSeq2Seq", "AutoModelForImageClassification",
                "AutoModelForVision2Seq", "AutoModel")


def model_class(cfg):
    """The class to build ``cfg`` with: its ``architectures[0]`` when transformers has it,
    else the first of ``AUTO_CLASSES`` that maps the config's type."""
    import transformers

    for arch in getattr(cfg, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    order = AUTO_CLASSES
    if getattr(cfg, "is_encoder_decoder", False):      # T5, Whisper: the whole model
        order = ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq") + AUTO_CLASSES
    for name in order:
        auto = getattr(transformers, name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is not None and type(cfg) in mapping:
            return auto
    raise ConfigError(f"model type {getattr(cfg, 'model_type', None)!r}: no transformers class "
                      f"builds this config (tried its architectures "
                      f"{getattr(cfg, 'architectures', None)} and {', '.join(AUTO_CLASSES)}); "
                      f"build the model yourself and call meshlab.plan(model, spec, mesh)")


def build(name_or_path: str, *, device: str = "meta", dtype=None, **overrides: Any):
    """Build the model of a preset or config on ``device`` (meta: no memory), with the class
    ``model_class`` picks (a causal LM for the presets)."""
    import torch

    cfg = config(name_or_path, **overrides)
    cls = model_class(cfg)
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    with torch.device(device):
        model = make(cfg, dtype=dtype) if dtype is not None else make(cfg)
    return model
