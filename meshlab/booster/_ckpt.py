"""The Booster's checkpoint methods over ``meshlab.checkpoint``.

A model or optimizer checkpoint is a directory, written atomically by every rank:

* the defaults (``shard=False``, ``use_safetensors=False``) write meshlab's sharded DCP
  checkpoint — each rank its shards, checksummed, reshardable onto any mesh, so a
  checkpoint saved under one plugin loads under any other; no pickles are written or read;
* ``use_safetensors=True`` or ``shard=True`` writes a Hugging Face export (``config.json``,
  safetensors shards of ``size_per_shard`` MB with their index with ``shard=True``, one
  file without) that ``from_pretrained`` reads, and ``load_model`` streams back into any
  layout. Colossal-AI's ``shard=True`` without safetensors writes ``.bin`` shards that
  ``from_pretrained`` reads; these are safetensors shards it reads alike, without pickles.

A path that names a file (``model.pt``, ``model.safetensors``; ``shard=False``) is one
file ``torch.load`` or safetensors reads, as Colossal-AI writes it (``_onefile``).

A learning-rate scheduler's state is a JSON file. Saves replace what the path held (as
Colossal-AI's do), never leaving a half-written checkpoint.

Each save records its step (the optimizer's step count; ``save_model`` reads the
optimizer ``boost`` built for the model), and a resume checks that what it loads belongs
together: a model, optimizer or scheduler loaded at another step than a part already
loaded for the same model (a kill between ``save_model`` and ``save_optimizer``, say)
raises ``CheckpointStepError`` naming both steps, before it loads anything. The
optimizer's next step starts a new resume (``load_optimizer`` restores its step count).
A load of a base model into a model with LoRA adapters meets peft's names (as
Colossal-AI's ``PeftUnwrapMixin`` does; ``meshlab.checkpoint``'s ``_names``).
"""

from __future__ import annotations

import json
import os

from ..core.errors import check_number
from . import _onefile
from ._args import Arg, bind, hint, maps, only

SAVE_MODEL = (
    maps("shard", False, "True: a Hugging Face export, safetensors shards of size_per_shard "
         "MB and their index (from_pretrained reads them, as it reads Colossal-AI's .bin "
         "shards); False: a path naming a file (model.pt, model.safetensors) gets one file "
         "torch.load or safetensors reads, a directory path one safetensors file with "
         "use_safetensors=True, else meshlab's DCP checkpoint, sharded by rank", True),
    hint("gather_dtensor", True, "DCP saves each rank's shards with the global layout, "
         "loadable on any mesh; safetensors exports hold whole tensors", False),
    only("prefix", None, "files are named as Hugging Face names them, so from_pretrained "
         "reads them", "a directory per checkpoint"),
    maps("size_per_shard", 1024, "checkpoint.save_pretrained(max_shard_size=int(n * 2**20)) "
         "with shard=True: MB as Colossal-AI counts them, a fraction too; unused without "
         "it, as in Colossal-AI", 64),
    maps("use_safetensors", False, "True: checkpoint.save_pretrained (a Hugging Face export); "
         "False: the same export with shard=True, else checkpoint.save (meshlab's sharded DCP "
         "checkpoint, no pickles)", True),
    maps("use_async", False, "checkpoint.save(async_save=True): the shards are copied to "
         "host memory and written in the background (DCP); a Hugging Face export or one file "
         "is written before save_model returns", True),
)
LOAD_MODEL = (
    maps("strict", True, "checkpoint.load/load_pretrained(strict=...)", False),
    hint("low_cpu_mem_mode", True, "loads stream shard by shard into each rank's slices",
         False),
    hint("num_threads", 1, "DCP and safetensors read each rank's own slices", 4),
)
SAVE_OPTIMIZER = (
    maps("shard", False, "either value: the state is saved sharded by rank (DCP, one file "
         "per rank, reshardable); no single-file form is written", True),
    hint("gather_dtensor", True, "DCP saves each rank's shards with the global layout, "
         "loadable on any mesh", False),
    only("prefix", None, "DCP names its files by rank", "a directory per checkpoint"),
    hint("size_per_shard", 1024, "DCP writes one file per rank", 64),
    maps("use_async", False, "checkpoint.save(async_save=True, weights=False)", True),
)
LOAD_OPTIMIZER = (
    only("prefix", None, "DCP names its files by rank", "a directory per checkpoint"),
    hint("low_cpu_mem_mode", True, "loads stream shard by shard into each rank's slices",
         False),
    hint("num_threads", 1, "DCP reads each rank's own slices", 4),
)
SAVE_LORA = (
    maps("use_safetensors", False, "meshlab.save_adapter(safe_serialization=...): True "
         "writes adapter_model.safetensors; False, as peft's save_pretrained, "
         "adapter_model.bin (tensors only: load_adapter reads it without running pickled "
         "code)", True),
)
ENABLE_LORA = (
    maps("pretrained_dir", None, "a saved adapter: its LoraConfig, and meshlab.load_adapter "
         "into the boosted model", "adapter"),
    maps("lora_config", None, "meshlab.lora(config), after the plugin's shard", "config"),
    maps("bnb_quantization_config", None, "lora(config, quantize=...): its load_in_4bit, "
         "bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype and "
         "skip_modules (None: the output head) as a meshlab Quantize; given, the base is "
         "quantized whatever quantize says, as Colossal-AI does; 8-bit and "
         "keep_in_fp32_modules are refused", "fp4"),
    maps("quantize", False, "lora(config, quantize=Quantize()): the Linear layers but the "
         "head in 4 bits (nf4, double quantization, bf16 products, Colossal-AI's defaults), "
         "frozen and replicated: TorchDDPPlugin, LowLevelZeroPlugin and "
         "HybridParallelPlugin(tp_size=1, pp_size=1) in precision 'fp32'; the other plugins "
         "and precisions are refused by name", True),
)
METHODS: dict[str, tuple[Arg, ...]] = {
    "save_model": SAVE_MODEL, "load_model": LOAD_MODEL, "save_optimizer": SAVE_OPTIMIZER,
    "load_optimizer": LOAD_OPTIMIZER, "save_lora_as_pretrained": SAVE_LORA,
    "enable_lora": ENABLE_LORA,
}


def _args(name: str, given: dict) -> dict:
    if given.get("prefix") == "":
        # Colossal-AI prefixes file names only with a non-empty prefix: "" is no prefix
        given = {**given, "prefix": None}
    return bind(f"Booster.{name}", METHODS[name], 0, (), given)


SCHEDULER_FORMAT = "meshlab.lr_scheduler/1"


def _step_of(self, model) -> int | None:
    """The step count of the optimizer ``boost`` built for ``model`` (None without one)."""
    opt = self._optimizer_of(model)
    steps = getattr(opt, "steps", None) if opt is not None else None
    return steps if isinstance(steps, int) else None


def _step_extra(step: int | None) -> dict | None:
    return {"step": step} if step is not None else None


def _saved_step(extra) -> int | None:
    step = (extra or {}).get("step") if isinstance(extra, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _loaded_parts(self, model) -> dict:
    """part -> (step, path) of what was loaded for ``model``'s resume since its optimizer
    last stepped (a step trains on from what was loaded: a later load starts anew)."""
    mark, parts = self._resume.get(id(model), (None, {}))
    return parts if mark == _step_of(self, model) else {}


def _check_resume(self, model, part: str, step: int | None, path: str) -> dict:
    """Before ``part`` of ``model``'s resume is loaded from ``path`` (saved at ``step``): a
    part already loaded for the model at another step is a ``CheckpointStepError``.
    Returns the parts loaded so far (for ``_record_resume``)."""
    from ..checkpoint import CheckpointStepError

    parts = _loaded_parts(self, model)
    for other, (s, p) in sorted(parts.items()):
        if other != part and None not in (s, step) and s != step:
            raise CheckpointStepError(
                f"Booster.load_{part}: {path} was saved at step {step}, but the {other} "
                f"loaded for this model (from {p}) at step {s}; a resume from them would "
                f"mix two steps. Load the {part} saved with the {other} (step {s}), or "
                f"the {other} saved at step {step}")
    return parts


def _record_resume(self, model, parts: dict, part: str, step: int | None, path: str) -> None:
    """After the load: ``part`` of the resume came from ``path``, saved at ``step``, beside
    ``parts``; valid until the optimizer's step count moves (a load of the optimizer
    restores it first)."""
    self._resume[id(model)] = (_step_of(self, model), {**parts, part: (step, path)})


def _marker_step(path: str) -> int | None:
    """The step a meshlab checkpoint's marker records (None where it records none, or the
    marker does not read: the load that follows names the damage)."""
    import warnings

    from ..checkpoint import CheckpointError, is_complete
    from ..checkpoint._commit import resolve
    from ..checkpoint._files import read_marker

    d = resolve(path, is_complete)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")         # the load warns once, itself
            return _saved_step(read_marker(d).get("extra")) if d is not None else None
    except CheckpointError:
        return None


def _is_dcp(path: str) -> bool:
    from ..checkpoint import is_complete
    from ..checkpoint._commit import resolve

    return resolve(path, is_complete) is not None


def save_model(self, model, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
               prefix: str | None = None, size_per_shard: int = 1024,
               use_safetensors: bool = False, use_async: bool = False) -> None:
    """Save the model's weights into directory ``checkpoint`` (see the module doc)."""
    from .. import checkpoint as ckpt

    v = _args("save_model", dict(shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                                 size_per_shard=size_per_shard,
                                 use_safetensors=use_safetensors, use_async=use_async))
    # MB as Colossal-AI counts them (2**20 bytes), a fraction too (its tests pass one)
    mb = check_number(v["size_per_shard"], "Booster.save_model", "size_per_shard",
                      example=1024)
    path = os.fspath(checkpoint)
    if not v["shard"] and _onefile.names_a_file(path):      # Colossal-AI's one file
        # use_async: written before save_model returns (the same file, complete sooner)
        _onefile.save(model, path, v["use_safetensors"], _step_extra(_step_of(self, model)))
        return
    if v["use_safetensors"] or v["shard"]:
        # use_async: the export is written before save_model returns (the same files)
        size = max(1, int(mb * 2 ** 20)) if v["shard"] else 2 ** 62
        ckpt.save_pretrained(checkpoint, model, max_shard_size=size,
                             extra=_step_extra(_step_of(self, model)))
        return
    ckpt.save(checkpoint, model, overwrite=True, async_save=v["use_async"],
              extra=_step_extra(_step_of(self, model)))


def load_model(self, model, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
               num_threads: int = 1) -> None:
    """Load weights saved by ``save_model`` (under any plugin) or any Hugging Face
    safetensors directory into the boosted ``model``."""
    from .. import checkpoint as ckpt
    from ..checkpoint import CheckpointError

    v = _args("load_model", dict(strict=strict, low_cpu_mem_mode=low_cpu_mem_mode,
                                 num_threads=num_threads))
    path = os.fspath(checkpoint).rstrip("/")
    if os.path.isfile(path):                     # one file: Colossal-AI's unsharded save
        _onefile.load(model, path, v["strict"])
        return
    if _is_dcp(path):
        step = _marker_step(path)
        parts = _check_resume(self, model, "model", step, path)
        ckpt.load(path, model, strict=v["strict"], restore_rng=False)
        _record_resume(self, model, parts, "model", step, path)
        return
    from ..checkpoint._hf import INDEX, SINGLE, exported, exported_extra
    from ..checkpoint._commit import resolve

    d = resolve(path, exported) or path
    if not (os.path.isfile(os.path.join(d, INDEX)) or os.path.isfile(os.path.join(d, SINGLE))):
        raise CheckpointError(f"Booster.load_model: {path} holds neither a meshlab checkpoint "
                              f"(meshlab.json) nor a safetensors export ({INDEX} or {SINGLE})")
    step = _saved_step(exported_extra(path))
    parts = _check_resume(self, model, "model", step, path)
    ckpt.load_pretrained(path, model, strict=v["strict"])
    _record_resume(self, model, parts, "model", step, path)


def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False,
                   gather_dtensor: bool = True, prefix: str | None = None,
                   size_per_shard: int = 1024, use_async: bool = False) -> None:
    """Save the optimizer's state (sharded, DCP) into directory ``checkpoint``."""
    from .. import checkpoint as ckpt

    v = _args("save_optimizer", dict(shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                                     size_per_shard=size_per_shard, use_async=use_async))
    model = self._model_of(optimizer, "save_optimizer")
    ckpt.save(checkpoint, model, optimizer, overwrite=True, async_save=v["use_async"],
              weights=False, extra=_step_extra(_step_of(self, model)))


def load_optimizer(self, optimizer, checkpoint: str, prefix: str | None = None,
                   low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
    """Load optimizer state saved by ``save_optimizer`` under any plugin."""
    from .. import checkpoint as ckpt

    _args("load_optimizer", dict(prefix=prefix, low_cpu_mem_mode=low_cpu_mem_mode,
                                 num_threads=num_threads))
    model = self._model_of(optimizer, "load_optimizer")
    path = os.fspath(checkpoint).rstrip("/")
    step = _marker_step(path)
    parts = _check_resume(self, model, "optimizer", step, path)
    ckpt.load(path, model, optimizer, weights=False, restore_rng=False)
    _record_resume(self, model, parts, "optimizer", step, path)


def _sched_model(self, lr_scheduler, call: str):
    return self._model_of(getattr(lr_scheduler, "optimizer", None), call)


def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
    """Write the scheduler's state as JSON to the file ``checkpoint`` (rank 0, atomic),
    with the step it was saved at and the checksum of its content."""
    from ..checkpoint._commit import write_json
    from ..checkpoint._files import seal
    from ..checkpoint._ranks import agree, as_error, ctrl_group, rank
    from ..checkpoint._state import _jsonable

    model = _sched_model(self, lr_scheduler, "save_lr_scheduler")
    err = None
    if rank() == 0:
        try:
            d = os.path.dirname(os.path.abspath(checkpoint))
            os.makedirs(d, exist_ok=True)
            state = _jsonable(lr_scheduler.state_dict(), "lr_scheduler.state_dict()")
            write_json(os.fspath(checkpoint), seal({"format": SCHEDULER_FORMAT, "state": state,
                                                    "step": _step_of(self, model)}))
        except Exception as e:
            err = as_error(e, "save_lr_scheduler", os.fspath(checkpoint))
    agree(ctrl_group(model), "Booster.save_lr_scheduler", error=err)


def _read_scheduler(checkpoint: str, lr_scheduler) -> tuple[dict, int | None]:
    """(state, step) from the file ``save_lr_scheduler`` wrote, checked: its checksum, and
    a state of this scheduler's form (a file of an earlier meshlab holds the state alone,
    without a step)."""
    from ..checkpoint import CheckpointError
    from ..checkpoint._files import check_digest
    from ..checkpoint._state import restored, same_shape

    try:
        with open(checkpoint, "rb") as f:
            doc = json.loads(f.read().decode())
    except UnicodeDecodeError:
        raise CheckpointError(f"Booster.load_lr_scheduler: {checkpoint} is not JSON (a pickled "
                              f"torch.save file?); meshlab never unpickles; save it with "
                              f"Booster.save_lr_scheduler") from None
    state, step = doc, None
    if isinstance(doc, dict) and doc.get("format") == SCHEDULER_FORMAT:
        check_digest(doc, os.fspath(checkpoint))
        state, step = doc.get("state"), _saved_step(doc)
    differs = same_shape(state, lr_scheduler.state_dict(), "state")
    if differs:
        raise CheckpointError(f"Booster.load_lr_scheduler: {checkpoint}: its {differs} "
                              f"({type(lr_scheduler).__name__}); load the state this "
                              f"scheduler saved")
    # JSON wrote a dict's int keys as strings (MultiStepLR's milestones): given back
    return restored(state, lr_scheduler.state_dict()), step


def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
    """Read the JSON state ``save_lr_scheduler`` wrote (a pickle is refused); a scheduler
    saved at another step than the model or optimizer loaded for the same model raises
    ``CheckpointStepError``."""
    from ..checkpoint._ranks import agree, as_error, ctrl_group

    model = _sched_model(self, lr_scheduler, "load_lr_scheduler")
    err, state, step, parts = None, None, None, {}
    try:
        state, step = _read_scheduler(os.fspath(checkpoint), lr_scheduler)
        parts = _check_resume(self, model, "lr_scheduler", step, os.fspath(checkpoint))
    except Exception as e:           # a CheckpointError is kept as it is
        err = as_error(e, "load_lr_scheduler", os.fspath(checkpoint))
    agree(ctrl_group(model), "Booster.load_lr_scheduler", error=err)
    lr_scheduler.load_state_dict(state)
    _record_resume(self, model, parts, "lr_scheduler", step, os.fspath(checkpoint))


def save_lora_as_pretrained(self, model, checkpoint: str, use_safetensors: bool = False) -> None:
    """Write the adapters in PEFT format (``meshlab.save_adapter``)."""
    from ..checkpoint.adapters import save_adapter

    v = _args("save_lora_as_pretrained", dict(use_safetensors=use_safetensors))
    save_adapter(checkpoint, model, safe_serialization=v["use_safetensors"])
