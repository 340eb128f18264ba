"""Loading a local Hugging Face model directory for the engine (``InferenceEngine(path)``,
``meshlab generate``): its config checked first, its weights and tokenizer from local
files only, and no code of the directory's own run."""

from __future__ import annotations

import os

import torch

from ..core.errors import ConfigError


def load_pretrained(path: str, dtype):
    """A local Hugging Face directory's causal LM (safetensors weights, in ``dtype``; on
    this rank's GPU where there is one) and its tokenizer (None where it has none).

    A directory whose config names code of its own (``auto_map``: a remote-code model) is
    refused: loading it would run that code, and transformers would first stop to ask on
    the terminal. Build such a model yourself and give the engine the model."""
    config = _read_config(path)
    if config.get("auto_map"):
        raise ConfigError(f"{path}: config.json names code of its own (auto_map: "
                          f"{sorted(config['auto_map'])}), which meshlab does not run. Load it "
                          f"yourself, model = AutoModelForCausalLM.from_pretrained({path!r}, "
                          f"trust_remote_code=True), and give the engine that model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                     use_safetensors=True,
                                                     trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path}: transformers cannot load a causal LM from it "
                          f"({type(e).__name__}: {e}); give a directory with config.json and "
                          f"its safetensors weights (meshlab.checkpoint.save_pretrained "
                          f"writes one)") from None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                            trust_remote_code=False)
    except (OSError, ValueError, KeyError):
        tok = None
    if torch.cuda.is_available():
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return model, tok


def _read_config(path: str) -> dict:
    """The object in ``path``'s config.json, or ``ConfigError`` saying what is wrong."""
    import json

    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ConfigError(f"{path}: no config.json there; give a Hugging Face model directory "
                          f"(a meshlab checkpoint is exported to one with "
                          f"meshlab.checkpoint.save_pretrained)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: not a readable JSON config ({e}); give a Hugging Face "
                          f"model directory") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: a Hugging Face config is a JSON object, got "
                          f"{type(config).__name__}")
    return config
