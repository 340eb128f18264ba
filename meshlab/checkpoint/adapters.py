"""Adapters out of and into a parallelized model, in PEFT's format.

``save_adapter(directory, model)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` does (keys
``base_model.model.<fqn>`` without the adapter name), so ``PeftModel.from_pretrained``
loads it on one process; ``load_adapter`` reads one into a parallelized model (each rank
takes its shard). ``save_merged`` writes the base model with the adapters merged in
(``W + scale * B @ A``; a module to save as its trained copy) as a Hugging Face
checkpoint for ``AutoModelForCausalLM.from_pretrained``. Writes go to ``<dir>.partial``
and are committed over ``<dir>`` as checkpoints are (``checkpoint._commit``). Every rank
calls these.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from ..transforms._install import runtime_of

ADAPTER = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def _full(p) -> torch.Tensor:
    to = getattr(p, "full_tensor", None)
    return (to() if to is not None else p).detach().to("cpu").clone()


def _gathered(model: nn.Module, keep) -> dict[str, torch.Tensor]:
    """``{fqn: full tensor}`` of the parameters ``keep(fqn)`` selects, on rank 0 (every
    rank calls; pipeline stages each contribute theirs)."""
    mine = {n: _full(p) for n, p in model.named_parameters() if keep(n)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    out: dict[str, torch.Tensor] = {}
    for part in parts or ():
        for n, t in part.items():
            out.setdefault(n, t)
    return out


def _peft_key(fqn: str) -> str:
    return "base_model.model." + fqn.replace(".default.", ".").replace(".modules_to_save.", ".")


def _adapter(n: str) -> bool:
    return ".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n


def _lora_config(model):
    t = next((t for t in runtime_of(model).plan.rooms if getattr(t, "kind", "") == "lora"), None)
    if t is None:
        from ..core.errors import ConfigError

        raise ConfigError("this model was parallelized without lora(); it has no adapters")
    return t.config


def _export(directory, model, what: str, files) -> str:
    """Rank 0 writes ``files()`` (name -> text, or a tensor dict for safetensors) into
    ``<dir>.partial`` and commits it over ``<dir>`` as the checkpoints do (``_commit``: a
    crash leaves the old export or the new one); a failure raises a ``CheckpointError``
    on every rank."""
    from safetensors.torch import save_file

    from ._commit import commit, discard, fsync_dir, recover
    from ._ranks import agree, as_error, ctrl_group

    directory = os.fspath(directory).rstrip("/")
    tmp, err = directory + ".partial", None
    if _rank0():
        try:
            recover(directory, os.path.isdir)
            os.makedirs(tmp)
            for name, data in files().items():
                path = os.path.join(tmp, name)
                if isinstance(data, dict):
                    save_file({k: v.contiguous() for k, v in data.items()}, path,
                              metadata={"format": "pt"})
                else:
                    with open(path, "w") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
            fsync_dir(tmp)
            commit(tmp, directory)
        except Exception as e:
            err = as_error(e, what, directory)
            try:
                discard(tmp)
            except OSError:
                pass                      # the next export tidies it
    agree(ctrl_group(model), f"lora.{what}", error=err)
    return directory


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_adapter(directory, model: nn.Module, *, base_model_name_or_path: str | None = None):
    """Write the adapters in PEFT format (see the module doc); returns ``directory``."""
    from ..transforms.lora._peft import jsonable as _jsonable

    cfg = _lora_config(model)
    tensors = _gathered(model, _adapter)

    def files():
        d = _jsonable(cfg.to_dict())
        d["base_model_name_or_path"] = base_model_name_or_path or \
            getattr(model.config, "_name_or_path", None)
        return {ADAPTER: {_peft_key(n): t for n, t in tensors.items()},
                CONFIG: json.dumps(d, indent=2)}

    return _export(directory, model, "save_adapter", files)


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state with every adapter merged in, keyed as the model was before
    peft (on rank 0; empty elsewhere)."""
    cfg = _lora_config(model)
    full = _gathered(model, lambda n: True)
    if not _rank0():
        return {}
    scale = cfg.lora_alpha / (cfg.r ** 0.5 if cfg.use_rslora else cfg.r)
    out: dict[str, torch.Tensor] = {}
    for n, t in full.items():
        if ".lora_A." in n or ".lora_B." in n or ".original_module." in n:
            continue
        if ".base_layer." in n:
            mod, name = n.split(".base_layer.")
            key = f"{mod}.{name}"
            a = full.get(f"{mod}.lora_A.default.weight")
            if name == "weight" and a is not None:
                b = full[f"{mod}.lora_B.default.weight"]
                t = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
            out[key] = t
            continue
        out[n.replace(".modules_to_save.default.", ".")] = t
    return out


def save_merged(directory, model: nn.Module) -> str:
    """The merged model as a Hugging Face checkpoint (``config.json`` and
    ``model.safetensors``)."""
    sd = merged_state(model)
    return _export(directory, model, "save_merged", lambda: {
        "model.safetensors": sd, "config.json": model.config.to_json_string()})


def load_adapter(directory, model: nn.Module) -> None:
    """Read a PEFT adapter into a parallelized model made with the same ``lora`` config
    (each rank copies its own shard of every adapter tensor)."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ..core.errors import ConfigError

    from ._commit import resolve

    d = os.fspath(directory).rstrip("/")      # after a crash mid-export: the committed one
    d = resolve(d, lambda x: os.path.isfile(os.path.join(x, ADAPTER))) or d
    files = load_file(os.path.join(d, ADAPTER))
    params = {n: p for n, p in model.named_parameters() if _adapter(n)}
    by_key = {_peft_key(n): n for n in params}
    missing = sorted(set(by_key) - set(files))
    if missing:
        raise ConfigError(f"load_adapter({os.fspath(directory)!r}): the adapter lacks "
                          f"{missing[:3]} ({len(missing)} in all); it was made for another "
                          f"lora config or model")
    with torch.no_grad():
        for key, n in by_key.items():
            p, t = params[n], files[key]
            if tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"load_adapter: {key} is {tuple(t.shape)}, the model's "
                                  f"{n} {tuple(p.shape)}")
            if isinstance(p, DTensor):
                t = distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()
                p.to_local().copy_(t)
            else:
                p.copy_(t.to(p.dtype))


def merge(model: nn.Module) -> int:
    """Merge every adapter into its base weight in place, on the sharded model (peft's
    own ``merge`` on each LoRA layer: its arithmetic runs on the DTensors, which
    communicate what they need); the forward then skips the adapters. Returns the layers
    merged."""
    return _each_layer(model, lambda m: m.merge())


def unmerge(model: nn.Module) -> int:
    """Undo ``merge``: the base weights again, the adapters in the forward."""
    return _each_layer(model, lambda m: m.unmerge())


def _each_layer(model: nn.Module, fn) -> int:
    from peft.tuners.lora import LoraLayer

    _lora_config(model)
    n = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLayer):
                fn(m)
                n += 1
    return n
