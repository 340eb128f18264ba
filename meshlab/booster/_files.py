"""Colossal-AI's checkpoint files of a whole (unsharded) model: one file that
``torch.load`` reads (or safetensors), or a directory of Hugging Face shards with its
index (``pytorch_model.bin.index.json`` / ``model.safetensors.index.json``, shards of at
most ``size_per_shard`` MB, names prefixed by ``prefix``) that ``from_pretrained`` reads.
Reading never unpickles anything but tensors and plain containers
(``torch.load(weights_only=True)``)."""

from __future__ import annotations

import json
import os

import torch

from ..core.errors import ConfigError

WEIGHTS, SAFE_WEIGHTS = "pytorch_model.bin", "model.safetensors"
STATES = "pytorch_optim.bin"


def _index_name(weights: str) -> str:
    return f"{weights}.index.json"


def _prefixed(name: str, prefix: str | None) -> str:
    return f"{prefix}-{name}" if prefix else name


def write_tensors(state: dict, path: str, safetensors: bool) -> None:
    """``state`` (name -> tensor) into the file ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if safetensors:
        from safetensors.torch import save_file

        save_file(_untied(state), path, metadata={"format": "pt"})
    else:
        torch.save(state, path)


def _untied(state: dict) -> dict:
    """safetensors refuses two names on one storage (tied weights): each its own copy."""
    seen: set = set()
    out = {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        out[k] = v.clone() if key in seen else v
        seen.add(key)
    return out


def read_tensors(path: str) -> dict:
    """The tensors of one file ``write_tensors`` (or Hugging Face) wrote."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def write_shards(state: dict, directory: str, safetensors: bool, size_mb: int,
                 prefix: str | None) -> None:
    """``state`` as shards of at most ``size_mb`` MB and their index in ``directory``."""
    base = SAFE_WEIGHTS if safetensors else WEIGHTS
    shards: list[dict] = [{}]
    size = 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > size_mb * 2 ** 20:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    os.makedirs(directory, exist_ok=True)
    stem, ext = base.rsplit(".", 1)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = _prefixed(f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}", prefix)
        write_tensors(shard, os.path.join(directory, name), safetensors)
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in state.values())
    with open(os.path.join(directory, _prefixed(_index_name(base), prefix)), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def read_any(path: str) -> dict:
    """The tensors of a file, or of a directory of shards with an index."""
    if os.path.isfile(path):
        return read_tensors(path)
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: no such checkpoint file or directory")
    index = [f for f in os.listdir(path) if f.endswith(".index.json")]
    if not index:
        single = [f for f in (SAFE_WEIGHTS, WEIGHTS) if os.path.isfile(os.path.join(path, f))]
        if single:
            return read_tensors(os.path.join(path, single[0]))
        raise ConfigError(f"{path}: a directory without an index (*.index.json) or "
                          f"{SAFE_WEIGHTS} / {WEIGHTS}")
    with open(os.path.join(path, index[0])) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out: dict = {}
    for name in files:
        out.update(read_tensors(os.path.join(path, name)))
    return out


def save_config(model, directory: str) -> None:
    """A Hugging Face model's ``config.json`` beside its shards (``from_pretrained`` reads
    it); nothing for another model."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
