"""The Booster's checkpoint methods over ``meshlab.checkpoint``.

A model or optimizer checkpoint is a directory, written atomically by every rank:

* ``use_safetensors=False`` (the default) writes meshlab's sharded DCP checkpoint — each
  rank its shards, checksummed, reshardable onto any mesh, so a checkpoint saved under
  one plugin loads under any other; no pickles are written or read;
* ``use_safetensors=True`` writes a Hugging Face export (``config.json``, safetensors
  shards of ``size_per_shard`` MB with ``shard=True``, one file without) that
  ``from_pretrained`` reads, and ``load_model`` streams back into any layout.

A learning-rate scheduler's state is a JSON file. Saves replace what the path held (as
Colossal-AI's do), never leaving a half-written checkpoint.
"""

from __future__ import annotations

import json
import os

from ..core.errors import check_int
from ._args import Arg, UnsupportedArgument, bind, hint, maps, only

_SHARDS = "size_per_shard applies to use_safetensors=True (DCP writes one file per rank)"

SAVE_MODEL = (
    maps("shard", False, "with use_safetensors=True: safetensors shards of size_per_shard MB "
         "and an index (False: one file); DCP checkpoints are always sharded by rank", True),
    hint("gather_dtensor", True, "DCP saves each rank's shards with the global layout, "
         "loadable on any mesh; safetensors exports hold whole tensors", False),
    only("prefix", None, "files are named as Hugging Face names them, so from_pretrained "
         "reads them", "a directory per checkpoint"),
    maps("size_per_shard", 1024, "checkpoint.save_pretrained(max_shard_size=f'{n}MB') "
         "(use_safetensors=True and shard=True)", 64),
    maps("use_safetensors", False, "True: checkpoint.save_pretrained (a Hugging Face export); "
         "False: checkpoint.save (meshlab's sharded DCP checkpoint, no pickles)", True),
    maps("use_async", False, "checkpoint.save(async_save=True): the shards are copied to "
         "host memory and written in the background (DCP only)", True),
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
    hint("use_safetensors", False, "meshlab.save_adapter always writes "
         "adapter_model.safetensors (peft reads it; no pickles)", True),
)
METHODS: dict[str, tuple[Arg, ...]] = {
    "save_model": SAVE_MODEL, "load_model": LOAD_MODEL, "save_optimizer": SAVE_OPTIMIZER,
    "load_optimizer": LOAD_OPTIMIZER, "save_lora_as_pretrained": SAVE_LORA,
}


def _args(name: str, given: dict) -> dict:
    return bind(f"Booster.{name}", METHODS[name], 0, (), given)


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
    check_int(v["size_per_shard"], "Booster.save_model", "size_per_shard", example=1024)
    if v["use_safetensors"]:
        if v["use_async"]:
            raise UnsupportedArgument("Booster.save_model", "use_async", True, "safetensors "
                                      "exports are written synchronously",
                                      "use_safetensors=False (DCP saves asynchronously)")
        size = f"{v['size_per_shard']}MB" if v["shard"] else 2 ** 62
        ckpt.save_pretrained(checkpoint, model, max_shard_size=size)
        return
    if v["size_per_shard"] != 1024:
        raise UnsupportedArgument("Booster.save_model", "size_per_shard", v["size_per_shard"],
                                  _SHARDS, "use_safetensors=True")
    ckpt.save(checkpoint, model, overwrite=True, async_save=v["use_async"])


def load_model(self, model, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
               num_threads: int = 1) -> None:
    """Load weights saved by ``save_model`` (under any plugin) or any Hugging Face
    safetensors directory into the boosted ``model``."""
    from .. import checkpoint as ckpt
    from ..checkpoint import CheckpointError

    v = _args("load_model", dict(strict=strict, low_cpu_mem_mode=low_cpu_mem_mode,
                                 num_threads=num_threads))
    path = os.fspath(checkpoint).rstrip("/")
    if _is_dcp(path):
        ckpt.load(path, model, strict=v["strict"], restore_rng=False)
        return
    from ..checkpoint._hf import INDEX, SINGLE, exported
    from ..checkpoint._commit import resolve

    d = resolve(path, exported) or path
    if not (os.path.isfile(os.path.join(d, INDEX)) or os.path.isfile(os.path.join(d, SINGLE))):
        raise CheckpointError(f"Booster.load_model: {path} holds neither a meshlab checkpoint "
                              f"(meshlab.json) nor a safetensors export ({INDEX} or {SINGLE})")
    ckpt.load_pretrained(path, model, strict=v["strict"])


def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False,
                   gather_dtensor: bool = True, prefix: str | None = None,
                   size_per_shard: int = 1024, use_async: bool = False) -> None:
    """Save the optimizer's state (sharded, DCP) into directory ``checkpoint``."""
    from .. import checkpoint as ckpt

    v = _args("save_optimizer", dict(shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                                     size_per_shard=size_per_shard, use_async=use_async))
    model = self._model_of(optimizer, "save_optimizer")
    ckpt.save(checkpoint, model, optimizer, overwrite=True, async_save=v["use_async"],
              weights=False)


def load_optimizer(self, optimizer, checkpoint: str, prefix: str | None = None,
                   low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
    """Load optimizer state saved by ``save_optimizer`` under any plugin."""
    from .. import checkpoint as ckpt

    _args("load_optimizer", dict(prefix=prefix, low_cpu_mem_mode=low_cpu_mem_mode,
                                 num_threads=num_threads))
    model = self._model_of(optimizer, "load_optimizer")
    ckpt.load(checkpoint, model, optimizer, weights=False, restore_rng=False)


def _sched_group(self, lr_scheduler):
    from ..checkpoint._ranks import ctrl_group

    opt = getattr(lr_scheduler, "optimizer", None)
    return ctrl_group(self._model_of(opt, "save_lr_scheduler"))


def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
    """Write the scheduler's state as JSON to the file ``checkpoint`` (rank 0, atomic)."""
    from ..checkpoint._commit import write_json
    from ..checkpoint._ranks import agree, as_error, rank
    from ..checkpoint._state import _jsonable

    group, err = _sched_group(self, lr_scheduler), None
    if rank() == 0:
        try:
            d = os.path.dirname(os.path.abspath(checkpoint))
            os.makedirs(d, exist_ok=True)
            write_json(os.fspath(checkpoint), _jsonable(lr_scheduler.state_dict(),
                                                        "lr_scheduler.state_dict()"))
        except Exception as e:
            err = as_error(e, "save_lr_scheduler", os.fspath(checkpoint))
    agree(group, "Booster.save_lr_scheduler", error=err)


def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
    """Read the JSON state ``save_lr_scheduler`` wrote (a pickle is refused)."""
    from ..checkpoint import CheckpointError
    from ..checkpoint._ranks import agree, as_error

    group, err, state = _sched_group(self, lr_scheduler), None, None
    try:
        with open(checkpoint) as f:
            state = json.load(f)
    except UnicodeDecodeError:
        err = CheckpointError(f"Booster.load_lr_scheduler: {checkpoint} is not JSON (a pickled "
                              f"torch.save file?); meshlab never unpickles; save it with "
                              f"Booster.save_lr_scheduler")
    except (OSError, ValueError) as e:
        err = as_error(e, "load_lr_scheduler", os.fspath(checkpoint))
    agree(group, "Booster.load_lr_scheduler", error=err)
    lr_scheduler.load_state_dict(state)


def save_lora_as_pretrained(self, model, checkpoint: str, use_safetensors: bool = False) -> None:
    """Write the adapters in PEFT format (``meshlab.save_adapter``)."""
    from ..checkpoint.adapters import save_adapter

    _args("save_lora_as_pretrained", dict(use_safetensors=use_safetensors))
    save_adapter(checkpoint, model)
