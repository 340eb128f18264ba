"""A boosted model's checkpoint as one file, as Colossal-AI's unsharded save writes it.

``save_model(model, "model.pt")`` (``shard=False``, a path that names a file) writes the
whole state dict into that file: ``torch.load`` reads it, or, for ``.safetensors`` or
``use_safetensors=True``, ``safetensors`` does. The parts of a model of any layout reach
rank 0 through ``save_pretrained``'s export (one tensor at a time), beside the path in
``<path>.meshlab-export``; rank 0 writes the file as ``<path>.partial`` and renames it
into place, so the path holds the old file or the new one, never half of one. Tied
weights keep both names in a ``torch.save`` file, as ``state_dict()`` gives them.

``load_model(model, "model.pt")`` reads such a file (or Colossal-AI's) without running
any pickled code (``torch.load(weights_only=True)``, or safetensors) and streams it into
any layout through ``load_pretrained``, which checks every name and shape on every rank
before it writes a weight. A failure on any rank raises on every rank.
"""

from __future__ import annotations

import os
import shutil

import torch

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


def names_a_file(path: str) -> bool:
    """Whether ``path`` names a file (its suffix) and no directory is there."""
    return path.endswith(SUFFIXES) and not os.path.isdir(path)


def _tied_names(model) -> dict[str, str]:
    """Each name of a parameter the model holds under an earlier name too -> that name."""
    first: dict[int, str] = {}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[n] = first[id(p)]
        else:
            first[id(p)] = n
    return out


def save(model, path: str, safetensors: bool, extra: dict | None) -> None:
    from .. import checkpoint as ckpt
    from ..checkpoint import CheckpointError, _fourbit
    from ..checkpoint._commit import resolve
    from ..checkpoint._hf import SINGLE, exported
    from ..checkpoint._ranks import agree, as_error, ctrl_group, rank
    from ._files import read_tensors, write_tensors

    four = _fourbit.weights(model)     # the same on every rank: the plan decides them
    if four:
        raise CheckpointError(
            f"Booster.save_model({path!r}): {len(four)} base weights (first {next(iter(four))}) "
            f"are held in 4 bits (lora(quantize=...)), and one file holds tensors only, not "
            f"the record of their quantization that a load checks; save to a directory: "
            f"save_model(model, 'ckpt/model') (meshlab's checkpoint) or with "
            f"use_safetensors=True (a safetensors export)")
    staging = path + ".meshlab-export"
    ckpt.save_pretrained(staging, model, max_shard_size=2 ** 62, extra=extra)
    err = None
    if rank() == 0:
        try:
            src = os.path.join(resolve(staging, exported) or staging, SINGLE)
            tmp = path + ".partial"
            if safetensors or path.endswith(".safetensors"):
                shutil.copyfile(src, tmp)
            else:
                state = read_tensors(src)
                for name, same in _tied_names(model).items():
                    if same in state and name not in state:
                        state[name] = state[same]
                write_tensors(state, tmp, safetensors=False)
            os.replace(tmp, path)
        except Exception as e:              # noqa: BLE001 (every rank raises it below)
            err = as_error(e, "Booster.save_model", path)
        finally:
            _remove(staging)
    agree(ctrl_group(model), "Booster.save_model (one file)", error=err)


def load(model, path: str, strict: bool) -> None:
    from .. import checkpoint as ckpt
    from ..checkpoint._hf import SINGLE
    from ..checkpoint._ranks import agree, as_error, barrier, ctrl_group, rank
    from ._files import read_tensors, write_tensors

    staging = path + ".meshlab-import"
    err = None
    if rank() == 0:
        try:
            _remove(staging)
            os.makedirs(staging)
            state = read_tensors(path) if path.endswith(".safetensors") else _read(path)
            tied = _tied_names(model)
            state = {k: v for k, v in state.items() if k not in tied}
            write_tensors(state, os.path.join(staging, SINGLE), safetensors=True)
        except Exception as e:              # noqa: BLE001
            err = as_error(e, "Booster.load_model", path)
    group = ctrl_group(model)
    agree(group, "Booster.load_model (one file)", error=err)
    try:
        ckpt.load_pretrained(staging, model, strict=strict)
    finally:
        barrier(group)
        if rank() == 0:
            _remove(staging)


def _read(path: str) -> dict:
    """A ``torch.save`` file of tensors, or safetensors under another suffix."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except Exception:
            pass
        raise


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
