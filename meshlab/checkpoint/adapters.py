"""Adapters out of and into a parallelized model, in PEFT's format.

``save_adapter(directory, model)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` does (keys
``base_model.model.<fqn>`` without the adapter name), so ``PeftModel.from_pretrained``
loads it on one process; ``load_adapter`` reads one into a parallelized model (each rank
takes its shard). ``save_merged`` writes the base model with the adapters merged in
(``W + scale * B @ A``; a module to save as its trained copy) as a Hugging Face
checkpoint for ``AutoModelForCausalLM.from_pretrained``. Writes go to ``<dir>.partial``
and are committed over ``<dir>`` as checkpoints are (``checkpoint._commit``), with a
checksum manifest (``checkpoint._manifest``) that ``load_adapter`` verifies. Every rank
calls these.

``load_adapter`` follows peft's: the adapter computes what its ``adapter_config.json``
says. A parallelized model's adapters were planned from its own ``lora`` config, so a
saved config that computes otherwise (another ``lora_alpha``, ``use_rslora``, target set,
...) is refused with both values named (build the model with
``lora(LoraConfig.from_pretrained(dir))``); so are tensors the model lacks.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.errors import ConfigError
from ..transforms._install import runtime_of

ADAPTER = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"      # peft's save_pretrained(safe_serialization=False)
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
    from ..transforms.lora import with_targets

    plan = runtime_of(model).plan           # the targets it runs: peft's defaults named
    return with_targets(t.config, plan.model.config_get("model_type"))


def _export(directory, model, what: str, files) -> str:
    """Rank 0 writes ``files()`` (name -> text, or a tensor dict for safetensors) into
    ``<dir>.partial`` and commits it over ``<dir>`` as the checkpoints do (``_commit``: a
    crash leaves the old export or the new one); a failure raises a ``CheckpointError``
    on every rank."""
    from safetensors.torch import save_file

    from . import _manifest
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
                if isinstance(data, dict) and name.endswith(".bin"):
                    torch.save({k: v.contiguous() for k, v in data.items()}, path)
                elif isinstance(data, dict):
                    save_file({k: v.contiguous() for k, v in data.items()}, path,
                              metadata={"format": "pt"})
                else:
                    with open(path, "w") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
            _manifest.write(tmp)
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


def _weights_file(d: str) -> str | None:
    """The adapter's weights file in directory ``d``: safetensors, else peft's ``.bin``."""
    return next((n for n in (ADAPTER, ADAPTER_BIN) if os.path.isfile(os.path.join(d, n))),
                None)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_adapter(directory, model: nn.Module, *, base_model_name_or_path: str | None = None,
                 safe_serialization: bool = True):
    """Write the adapters in PEFT format (see the module doc); returns ``directory``.
    ``safe_serialization=False`` writes ``adapter_model.bin`` (tensors only, which
    ``torch.load(weights_only=True)`` reads), as peft's ``save_pretrained`` does."""
    from ..transforms.lora._peft import jsonable as _jsonable

    cfg = _lora_config(model)
    tensors = _gathered(model, _adapter)

    def files():
        d = _jsonable(cfg.to_dict())
        d["base_model_name_or_path"] = base_model_name_or_path or \
            getattr(model.config, "_name_or_path", None)
        return {ADAPTER if safe_serialization else ADAPTER_BIN:
                {_peft_key(n): t for n, t in tensors.items()}, CONFIG: json.dumps(d, indent=2)}

    return _export(directory, model, "save_adapter", files)


def _merged_names(model: nn.Module) -> list[tuple[str, str]]:
    """``(name in the merged export, the model's tensor name)`` for every tensor of the
    base model: a LoRA layer's base weight under the name it had before peft, a module to
    save as its trained copy; the adapters themselves and the frozen originals left out."""
    from ._hf import _tensors

    out = []
    for n, _ in _tensors(model):
        if ".lora_A." in n or ".lora_B." in n or ".original_module." in n:
            continue
        out.append((n.replace(".base_layer.", ".").replace(".modules_to_save.default.", "."), n))
    return out


def _full_precision_base(model: nn.Module, call: str, why: str = "") -> None:
    """A merge adds each delta to the base weight's values: a 4-bit base
    (``lora(quantize=...)``) holds packed bytes, and is refused here by name (``why``: what
    merging into it would do, for the calls that would)."""
    from ..core.errors import ConfigError
    from ..core.units import PACKED_4BIT

    four = [e.fqn for e in runtime_of(model).plan.params if e.dtype in PACKED_4BIT]
    if four:
        raise ConfigError(f"{call}: {len(four)} base weights (first {four[0]}) are held in 4 "
                          f"bits (lora(quantize=...)){why}; save the adapter (save_adapter) "
                          f"and merge it into the full-precision base with peft "
                          f"(PeftModel.from_pretrained(base, dir).merge_and_unload())")


def _merger(model: nn.Module, cfg):
    """``(transform, adapters)``: the adapters of every LoRA layer gathered whole on rank 0
    (each small: r x features), and the function that merges them into a base weight as it
    passes rank 0 (``W + scale * B @ A``, transposed for ``fan_in_fan_out`` layers, as
    peft's ``merge`` computes it)."""
    scale = cfg.lora_alpha / (cfg.r ** 0.5 if cfg.use_rslora else cfg.r)
    adapters = _gathered(model, lambda n: ".lora_A." in n or ".lora_B." in n)
    by_export = {e: n for e, n in _merged_names(model)}

    def transform(name: str, w: torch.Tensor) -> torch.Tensor:
        src = by_export.get(name, name)
        if ".base_layer." not in src or not src.endswith(".weight"):
            return w
        mod = src.split(".base_layer.")[0]
        a = adapters.get(f"{mod}.lora_A.default.weight")
        if a is None:
            return w
        # float32 at least, float64 for a float64 model (float32 rounded its export)
        acc = torch.promote_types(w.dtype, torch.float32)
        delta = adapters[f"{mod}.lora_B.default.weight"].to(acc) @ a.to(acc)
        if cfg.fan_in_fan_out:
            delta = delta.T
        return (w.to(acc) + scale * delta).to(w.dtype)

    return transform, adapters


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state with every adapter merged in, keyed as the model was before
    peft, on rank 0 (empty elsewhere): the whole model in one process, for small models;
    ``save_merged`` streams it to files instead."""
    cfg = _lora_config(model)
    _full_precision_base(model, "merged_state")
    transform, _ = _merger(model, cfg)
    full = _gathered(model, lambda n: True)
    if not _rank0():
        return {}
    return {e: transform(e, full[n]) for e, n in _merged_names(model)}


def save_merged(directory, model: nn.Module, *, max_shard_size: int | str = "5GB") -> str:
    """The merged model as a Hugging Face checkpoint (``config.json``, safetensors and
    their index, the checksum manifest), streamed as ``save_pretrained`` streams: one
    parameter at a time is gathered, merged on rank 0 and written, so no rank ever holds
    the whole model."""
    from ._hf import _tensors, export_tensors

    cfg = _lora_config(model)
    _full_precision_base(model, "save_merged")
    transform, _ = _merger(model, cfg)
    tensors = dict(_tensors(model))
    items = [(e, tensors[n]) for e, n in _merged_names(model)]
    return export_tensors(directory, model, items, max_shard_size=max_shard_size,
                          transform=transform, what="save_merged")


def load_adapter(directory, model: nn.Module) -> None:
    """Read a PEFT adapter into a parallelized model made with the same ``lora`` config
    (each rank copies its own shard of every adapter tensor). Its files are verified
    against the manifest ``save_adapter`` wrote (a foreign adapter has none), its config
    against the model's (``AdapterConfigError``), and its tensors must be the model's
    adapters, each of its shape."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ._commit import resolve
    from ._ranks import agree, as_error, ctrl_group

    d = os.fspath(directory).rstrip("/")      # after a crash mid-export: the committed one
    d = resolve(d, lambda x: _weights_file(x) is not None) or d
    params = {n: p for n, p in model.named_parameters() if _adapter(n)}
    files, err = {}, None
    try:
        files = _read_adapter(d, model, {_peft_key(n): n for n in params})
    except Exception as e:
        err = as_error(e, "load_adapter", d)
    agree(ctrl_group(model), "lora.load_adapter", error=err)
    with torch.no_grad():
        for key, t in files.items():
            p = params[key]
            if isinstance(p, DTensor):
                t = distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()
                p.to_local().copy_(t)
            else:
                p.copy_(t.to(p.dtype))


# What a LoRA config decides of the function an adapter computes (dropout only trains).
_COMPUTES = ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules",
             "modules_to_save", "bias", "fan_in_fan_out", "use_dora", "layers_to_transform",
             "layers_pattern", "rank_pattern", "alpha_pattern")


def _same(a, b) -> bool:
    """Two config values alike as peft reads them (a list of targets is a set; an empty
    list or dict is no value)."""
    def norm(v):
        if v in ([], {}, ()):
            return None
        return sorted(v) if isinstance(v, (list, tuple, set)) else v

    return norm(a) == norm(b)


def _check_config(saved: dict, cfg, where: str) -> None:
    """The saved ``adapter_config.json`` computes what the model's LoRA config does."""
    from ..transforms.lora._peft import jsonable as _jsonable
    from ._safe import AdapterConfigError

    own = _jsonable(cfg.to_dict())
    for key in _COMPUTES:
        if key in saved and not _same(saved[key], own.get(key)):
            raise AdapterConfigError(
                f"load_adapter({where!r}): the adapter was saved with {key}="
                f"{saved[key]!r}, this model's lora config has {key}={own.get(key)!r}; "
                f"the adapter would compute otherwise than it was trained. Build the "
                f"model with lora(LoraConfig.from_pretrained({where!r}))")


def _read_adapter(d: str, model: nn.Module, by_key: dict[str, str]) -> dict:
    """The adapter's tensors, after its files, config and keys were checked."""
    from safetensors.torch import load_file

    from . import _manifest
    from ._safe import AdapterConfigError, CheckpointError

    weights = _weights_file(d) or ADAPTER
    doc = _manifest.check(d)
    for name in (weights, CONFIG):
        _manifest.listed(doc, d, name)
    try:
        with open(os.path.join(d, CONFIG), "rb") as f:
            saved = json.loads(f.read().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{d} has no {CONFIG}: an adapter's config says what it "
                              f"computes; save it with save_adapter (or peft's "
                              f"save_pretrained)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(d, CONFIG)} is damaged ({e})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{os.path.join(d, CONFIG)} is damaged: not a JSON object")
    _check_config(saved, _lora_config(model), d)
    path = os.path.join(d, weights)
    try:                          # a .bin file: tensors only, no pickled code runs
        files = load_file(path) if weights == ADAPTER else \
            torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:        # missing, truncated or garbage header
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); save the "
                              f"adapter again") from None
    missing = sorted(set(by_key) - set(files))
    unexpected = sorted(set(files) - set(by_key))
    if missing or unexpected:
        raise AdapterConfigError(
            f"load_adapter({d!r}): the adapter lacks {missing[:3]} ({len(missing)} in all) "
            f"and holds {unexpected[:3]} that the model does not ({len(unexpected)} in all); "
            f"it was made for another lora config or model")
    params = dict(model.named_parameters())
    for key, n in by_key.items():
        if tuple(files[key].shape) != tuple(params[n].shape):
            raise AdapterConfigError(f"load_adapter: {key} is {tuple(files[key].shape)}, the "
                                     f"model's {n} {tuple(params[n].shape)}")
    return {n: files[key] for key, n in by_key.items()}


def merge(model: nn.Module) -> int:
    """Merge every adapter into its base weight in place, on the sharded model (peft's
    own ``merge`` on each LoRA layer: its arithmetic runs on the DTensors, which
    communicate what they need); the forward then skips the adapters. Returns the layers
    merged. A 4-bit base (``lora(quantize=...)``) is refused (``_in_place``)."""
    _in_place(model, "merge_adapters")
    return _each_layer(model, lambda m: m.merge())


def unmerge(model: nn.Module) -> int:
    """Undo ``merge``: the base weights again, the adapters in the forward."""
    _in_place(model, "unmerge_adapters")
    return _each_layer(model, lambda m: m.unmerge())


def _in_place(model: nn.Module, call: str) -> None:
    """peft merges an adapter into a 4-bit base by dequantizing it, adding the delta and
    quantizing the sum again: the merged base rounds the delta to 4 bits, and unmerging
    subtracts it and quantizes once more, which does not give the base's bytes back. Both
    are refused by name, before any layer changes."""
    _lora_config(model)
    _full_precision_base(model, call, ": merging into them quantizes the sum again (lossy), "
                         "and unmerging would not restore their bytes; keep the adapters "
                         "beside the base (they compute the same)")


def _each_layer(model: nn.Module, fn) -> int:
    from peft.tuners.lora import LoraLayer

    _lora_config(model)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name, m in layers:       # all checked before any layer changes
        kinds = {isinstance(p, DTensor) for p in m.parameters()}
        if len(kinds) > 1:
            raise ConfigError(
                f"merge_adapters / unmerge_adapters: {name} holds its base weight and its "
                f"adapters in different layouts (tensor parallelism splits the base and "
                f"one of A, B; peft's merge multiplies them as plain tensors). Write the "
                f"merged weights with ml.save_merged(model, dir), which gathers them, or "
                f"merge on a layout without tensor parallelism")
    with torch.no_grad():
        for _, m in layers:
            fn(m)
    return len(layers)
