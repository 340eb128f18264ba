"""Colossal-AI's ``CheckpointIO`` API: ``GeneralCheckpointIO`` saves and loads a model,
optimizer and scheduler of one process (a model nobody parallelized) in Colossal-AI's
files (``_files``); ``booster.checkpoint_io`` is the boosted objects' (``BoosterIO``:
the Booster's own methods, over ``meshlab.checkpoint``).

>>> from meshlab.booster.checkpoint_io import GeneralCheckpointIO
>>> io = GeneralCheckpointIO()
>>> io.save_model(model, "model.bin")          # torch.load("model.bin") reads it  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os

import torch

from ...core.errors import ConfigError
from .. import _files


class CheckpointIO:
    """Save and load a model, optimizer and scheduler; writes finish before a call returns,
    so ``_sync_d2h`` and ``_sync_io`` only wait for a background save of the Booster's."""

    def _sync_d2h(self) -> None:
        from ...checkpoint import wait

        wait()

    def _sync_io(self) -> None:
        from ...checkpoint import wait

        wait()


class GeneralCheckpointIO(CheckpointIO):
    """One process's model and optimizer in Colossal-AI's files: ``shard=False`` writes the
    file ``checkpoint`` (``torch.load`` reads it; safetensors with ``use_safetensors``),
    ``shard=True`` a directory of shards of ``size_per_shard`` MB with their index, named
    with ``prefix``, that ``from_pretrained`` reads (with the model's config)."""

    def save_model(self, model, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: str | None = None, size_per_shard: int = 1024,
                   use_safetensors: bool = False, use_async: bool = False) -> None:
        state = model.state_dict()
        safe = use_safetensors or (use_async and str(checkpoint).endswith(".safetensors"))
        if shard:
            _files.write_shards(state, os.fspath(checkpoint), safe, size_per_shard, prefix)
            _files.save_config(model, os.fspath(checkpoint))
        else:
            _files.write_tensors(state, os.fspath(checkpoint), safe)

    def load_model(self, model, checkpoint: str, strict: bool = True,
                   low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
        model.load_state_dict(_files.read_any(os.fspath(checkpoint)), strict=strict)

    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False,
                       gather_dtensor: bool = True, prefix: str | None = None,
                       size_per_shard: int = 1024, use_async: bool = False) -> None:
        state = optimizer.state_dict()
        if not shard:
            os.makedirs(os.path.dirname(os.path.abspath(checkpoint)) or ".", exist_ok=True)
            if os.fspath(checkpoint).endswith(".safetensors"):
                _write_flat_optimizer(state, os.fspath(checkpoint))
            else:
                torch.save(state, os.fspath(checkpoint))
            return
        _save_sharded_optimizer(state, os.fspath(checkpoint), size_per_shard, prefix)

    def load_optimizer(self, optimizer, checkpoint: str, prefix: str | None = None,
                       low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
        path = os.fspath(checkpoint)
        if os.path.isdir(path):
            state = _load_sharded_optimizer(path)
        elif path.endswith(".safetensors"):
            state = _read_flat_optimizer(path, optimizer)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state)

    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        torch.save(lr_scheduler.state_dict(), os.fspath(checkpoint))

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        lr_scheduler.load_state_dict(torch.load(os.fspath(checkpoint), map_location="cpu",
                                                weights_only=True))


_OPTIM_INDEX = f"{_files.STATES}.index.json"
_FLAT_FORMAT = "meshlab.optimizer/1"


def _write_flat_optimizer(state: dict, path: str) -> None:
    """An optimizer's state as one safetensors file (what a ``*.safetensors`` name means to
    Colossal-AI's loader and to ``torch.load``): each state tensor as
    ``state.<index>.<name>``, the param groups and the state's other values as JSON in
    the metadata (Colossal-AI pickles them into byte tensors; meshlab reads no pickles)."""
    from safetensors.torch import save_file

    from ..utils.safetensors import flatten_state

    tensors, other = flatten_state(state["state"], sep=".")
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    try:
        meta = {"format": "pt", "meshlab": _FLAT_FORMAT,
                "param_groups": json.dumps(state["param_groups"]),
                "other_state": json.dumps(other)}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"save_optimizer: {path}: the optimizer's param groups or state "
                          f"hold a value JSON cannot write ({e}); a *.safetensors file keeps "
                          f"everything but tensors as JSON: save to another name (optim.bin, "
                          f"torch.save's file)") from None
    save_file(_files._untied(tensors), path, metadata=meta)


def _read_flat_optimizer(path: str, optimizer) -> dict:
    """The state ``_write_flat_optimizer`` wrote, its groups' tuples (betas) given back as
    tuples after the optimizer's own groups."""
    from safetensors import safe_open

    from ...checkpoint._state import restored
    from ..utils.safetensors import nest_state

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("meshlab") != _FLAT_FORMAT:
            pickled = " (its non-tensor values are pickles, as Colossal-AI writes them)" \
                if "non_tensor_keys" in meta else ""
            raise ConfigError(f"load_optimizer: {path} is not an optimizer state meshlab "
                              f"wrote{pickled}; meshlab does not unpickle: save it again "
                              f"with meshlab's save_optimizer, or torch.save its state_dict() "
                              f"to a .bin name")
        flat = {k: f.get_tensor(k) for k in f.keys()}
    flat.update(json.loads(meta["other_state"]))
    state = nest_state(flat, ".", f"load_optimizer({path!r})")
    groups = json.loads(meta["param_groups"])
    own = optimizer.state_dict()["param_groups"]
    if len(groups) == len(own):
        groups = [restored(g, o) for g, o in zip(groups, own)]
    return {"state": state, "param_groups": groups}
_GROUPS = "pytorch_optim_group.bin"


def _save_sharded_optimizer(state: dict, directory: str, size_mb: int, prefix) -> None:
    """Each parameter's state into shards of at most ``size_mb`` MB, the groups apart."""
    os.makedirs(directory, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for idx, st in state["state"].items():
        n = sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        if shards[-1] and size + n > size_mb * 2 ** 20:
            shards.append({})
            size = 0
        shards[-1][idx] = st
        size += n
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"{prefix + '-' if prefix else ''}pytorch_optim-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, os.path.join(directory, name))
        weight_map.update({str(k): name for k in shard})
    torch.save(state["param_groups"], os.path.join(directory, _GROUPS))
    with open(os.path.join(directory, _OPTIM_INDEX), "w") as f:
        json.dump({"metadata": {"param_groups": _GROUPS}, "weight_map": weight_map}, f, indent=1)


def _load_sharded_optimizer(directory: str) -> dict:
    index = os.path.join(directory, _OPTIM_INDEX)
    if not os.path.isfile(index):
        raise ConfigError(f"load_optimizer: {directory} holds no {_OPTIM_INDEX}; give the "
                          f"directory save_optimizer(shard=True) wrote, or its file")
    with open(index) as f:
        doc = json.load(f)
    state: dict = {}
    for name in sorted(set(doc["weight_map"].values())):
        state.update(torch.load(os.path.join(directory, name), map_location="cpu",
                                weights_only=True))
    groups = torch.load(os.path.join(directory, doc["metadata"]["param_groups"]),
                        map_location="cpu", weights_only=True)
    return {"state": state, "param_groups": groups}


class BoosterIO(CheckpointIO):
    """``booster.checkpoint_io``: the Booster's checkpoint methods (``save_model``, ...)
    and the wait for its background save."""

    def __init__(self, booster) -> None:
        self._booster = booster

    def __getattr__(self, name: str):
        if name.startswith(("save_", "load_")):
            return getattr(self._booster, name)
        raise AttributeError(f"checkpoint_io has no attribute {name!r}")
