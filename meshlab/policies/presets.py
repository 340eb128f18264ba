"""Named model shapes (Hugging Face configs) to plan and train without downloading.

>>> sorted(PRESETS)[:3]
['gpt2-small', 'llama3-405b', 'llama3-70b']
"""

from __future__ import annotations

from typing import Any

from ..core.errors import ConfigError

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
    """A ``transformers`` config from a preset name or a local ``config.json`` path (a file
    or its directory). A file that is no config, or whose ``model_type`` the installed
    transformers does not know, raises ``ConfigError`` naming the path."""
    import os

    if os.path.exists(name_or_path):
        cfg = _config_file(name_or_path)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return cfg
    if name_or_path not in PRESETS:
        raise ConfigError(
            f"model {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            f"path to a config.json"
        )
    from transformers import AutoConfig

    kw = {**PRESETS[name_or_path], **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _config_file(path: str):
    """The config of ``path`` (a config.json or the directory holding one)."""
    import json
    import os

    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config {path!r}: cannot read it as a JSON config ({e}); give a "
                          f"Hugging Face config.json or the directory holding one") from None
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(mt, str):
        raise ConfigError(f"config {path!r}: no \"model_type\" in it; a Hugging Face "
                          f"config.json names its family, e.g. \"model_type\": \"llama\"")
    if mt not in CONFIG_MAPPING:
        raise ConfigError(f"config {path!r}: model_type {mt!r} is unknown to transformers "
                          f"{transformers.__version__}; build the model in Python and pass "
                          f"it to meshlab.plan(model, spec, mesh)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:                      # the family's own config validation
        raise ConfigError(f"config {path!r}: transformers rejects this {mt} config: "
                          f"{type(e).__name__}: {e}") from None


def model_class(cfg):
    """The class to build ``cfg`` with: its ``architectures[0]`` when transformers has it,
    else the one ``meshlab.policies.models.auto_class`` picks (``ConfigError`` when none)."""
    import transformers

    from .models import auto_class

    for arch in getattr(cfg, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return auto_class(cfg)


def build(name_or_path: str, *, device: str = "meta", dtype=None, **overrides: Any):
    """Build the model of a preset or config on ``device`` (meta: no memory, no weights),
    with the class ``model_class`` picks (a causal LM for the presets)."""
    import torch

    from .models import from_config

    cfg = config(name_or_path, **overrides)
    cls = model_class(cfg)
    kw = {} if dtype is None else {"dtype": dtype}
    try:
        with torch.device(device):
            return from_config(cls, cfg, **kw)
    except Exception as e:                      # the model's own constructor refused it
        raise ConfigError(f"model_type {cfg.model_type!r}: {cls.__name__} could not be built "
                          f"from this config: {type(e).__name__}: {e}") from None
