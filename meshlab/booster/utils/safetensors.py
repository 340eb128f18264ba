"""Colossal-AI's ``colossalai.utils.safetensors``: safetensors files written in the
background, and an optimizer's nested state as one flat file.

``save``, ``save_nested`` and ``move_and_save`` return a writer at once; the file is
serialized and written on a thread of its own. ``writer.sync_before_step()`` returns once
every tensor has been read (the next optimizer step may change them), and
``writer.synchronize()`` once the file is complete on disk; either raises the writer's
error. The file is written under a temporary name and renamed into place, so ``path``
never holds half a file.

A nested optimizer state (``{"state": {i: {name: value}}, "param_groups": [...]}``, or
its ``state`` alone, a shard of it) is flattened as Colossal-AI flattens it: each tensor
under ``state-<i>-<name>``. The values that are not tensors (the param groups, a step
kept as a number) go to the file's metadata as JSON, tuples tagged so they come back as
tuples (Adam's ``betas``); Colossal-AI pickles them into byte tensors instead, and
``load_flat`` refuses such a file by name, since meshlab never unpickles.

>>> import os, tempfile, torch
>>> state = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2)}},
...          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}
>>> path = os.path.join(tempfile.mkdtemp(), "optim.safetensors")
>>> save_nested(path, state).synchronize()
>>> back = load_flat(path)
>>> back["param_groups"], back["state"][0]["exp_avg"]
([{'lr': 0.1, 'betas': (0.9, 0.999), 'params': [0]}], tensor([1., 1.]))
"""

from __future__ import annotations

import json
import os
import threading

import torch

from ...core.errors import ConfigError

_OBJECTS = "meshlab_objects"     # the metadata key of the values that are not tensors
_TUPLE = "__tuple__"


def _encode(value):
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(value):
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(v) for v in value[_TUPLE])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


class AsyncWriter:
    """One safetensors file written on a background thread (``save``'s result)."""

    def __init__(self, path: str, tensors: dict, metadata: dict | None, ready=None):
        self.path = os.fspath(path)
        self._tensors, self._metadata, self._ready = tensors, metadata, ready
        self._read = threading.Event()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="meshlab-safetensors",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from safetensors.torch import save as serialize

        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            if self._ready is not None:        # the copies out of device memory
                self._ready.synchronize()
            blob = serialize(self._tensors, metadata=self._metadata)
            self._tensors = None
            self._read.set()
            os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException as e:            # re-raised by sync_before_step / synchronize
            self._error.append(e)
            if os.path.exists(tmp):
                os.remove(tmp)
        finally:
            self._read.set()

    def _raise(self) -> None:
        if self._error:
            e = self._error[0]
            raise ConfigError(f"writing {self.path} failed: {type(e).__name__}: {e}") from e

    def sync_before_step(self) -> None:
        """Wait until every tensor has been read: they may change from here on."""
        self._read.wait()
        self._raise()

    def synchronize(self) -> None:
        """Wait until the file is complete at its path."""
        self._thread.join()
        self._raise()


def _metadata(metadata: dict | None, objects: dict | None = None) -> dict:
    meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str):
            raise ConfigError(f"safetensors metadata key {k!r}: keys are strings")
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    if objects:
        try:
            meta[_OBJECTS] = json.dumps({k: _encode(v) for k, v in objects.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"save_nested: a value that is not a tensor cannot be written "
                              f"as JSON ({e}); keep numbers, strings, lists, tuples and "
                              f"dicts beside the tensors") from None
    return meta


def _host(tensors: dict) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def save(path: str, state_dict: dict, metadata: dict | None = None) -> AsyncWriter:
    """Write ``state_dict`` (name -> tensor) to the safetensors file ``path`` in the
    background."""
    bad = [k for k, v in state_dict.items() if not torch.is_tensor(v)]
    if bad:
        raise ConfigError(f"save({path!r}): {bad[0]!r} is not a tensor; save writes a flat "
                          f"name -> tensor dict (save_nested takes an optimizer's state)")
    from .._files import _untied

    return AsyncWriter(path, _untied(_host(state_dict)), _metadata(metadata))


def flatten_state(state_dict: dict, sep: str = "-") -> tuple[dict, dict]:
    """(tensors, other values) of a nested optimizer state, keyed ``state-<i>-<name>``
    (and ``param_groups``)."""
    states = state_dict["state"] if "state" in state_dict else state_dict
    tensors, objects = {}, {}
    for idx, d in states.items():
        for k, v in d.items():
            key = f"state{sep}{idx}{sep}{k}"
            (tensors if torch.is_tensor(v) else objects)[key] = v
    if "param_groups" in state_dict:
        objects["param_groups"] = state_dict["param_groups"]
    return tensors, objects


def save_nested(path: str, state_dict: dict) -> AsyncWriter:
    """Write an optimizer's nested state (or its ``state`` alone) to ``path`` in the
    background, flattened (see the module doc)."""
    tensors, objects = flatten_state(state_dict)
    from .._files import _untied

    return AsyncWriter(path, _untied(_host(tensors)), _metadata(None, objects))


def move_and_save(path: str, state_dict: dict, state_dict_pinned: dict | None = None,
                  metadata: dict | None = None) -> AsyncWriter:
    """Copy ``state_dict`` (device tensors) into ``state_dict_pinned`` (host buffers of
    the same names, e.g. from ``create_pinned_state_dict``) without blocking, and write
    them to ``path`` in the background once the copies are done; without pinned
    buffers, into fresh host tensors."""
    host, ready = {}, None
    for k, v in state_dict.items():
        if not torch.is_tensor(v):
            raise ConfigError(f"move_and_save({path!r}): {k!r} is not a tensor")
        if state_dict_pinned is not None:
            if k not in state_dict_pinned:
                raise ConfigError(f"move_and_save({path!r}): state_dict_pinned has no {k!r}; "
                                  f"make it from the same state dict "
                                  f"(create_pinned_state_dict(state_dict))")
            dst = state_dict_pinned[k]
            if dst.shape != v.shape or dst.dtype != v.dtype:
                raise ConfigError(f"move_and_save({path!r}): {k!r} is {tuple(v.shape)} "
                                  f"{v.dtype}, its pinned buffer {tuple(dst.shape)} "
                                  f"{dst.dtype}; make the buffers from this state dict")
            host[k] = dst.copy_(v.detach(), non_blocking=True)
        else:
            host[k] = v.detach().to("cpu", non_blocking=v.is_cuda)
        if v.is_cuda and ready is None:
            ready = torch.cuda.Event()
    if ready is not None:
        ready.record()
    return AsyncWriter(path, host, _metadata(metadata), ready=ready)


def load_flat(checkpoint_path: str, seperator: str = "-") -> dict:
    """The nested state ``save_nested`` wrote (``seperator`` as Colossal-AI spells it),
    or the flat tensors of a file ``save`` wrote."""
    from safetensors import safe_open

    with safe_open(os.fspath(checkpoint_path), framework="pt") as f:
        meta = f.metadata() or {}
        if "non_tensor_keys" in meta:
            raise ConfigError(f"load_flat({checkpoint_path!r}): the file's non-tensor values "
                              f"are pickles (Colossal-AI's save_nested writes them so), and "
                              f"meshlab never unpickles; write it again with "
                              f"meshlab.booster.utils.safetensors.save_nested")
        flat = {k: f.get_tensor(k) for k in f.keys()}
    objects = {k: _decode(v) for k, v in json.loads(meta.get(_OBJECTS, "{}")).items()}
    flat.update(objects)
    if not any(k.startswith(f"state{seperator}") for k in flat) and "param_groups" not in flat:
        return flat
    out: dict = {}
    if "param_groups" in flat:
        out["param_groups"] = flat.pop("param_groups")
        out["state"] = nest_state(flat, seperator, f"load_flat({checkpoint_path!r})")
        return out
    return nest_state(flat, seperator, f"load_flat({checkpoint_path!r})")


def nest_state(flat: dict, sep: str, where: str) -> dict:
    """``{index: {name: value}}`` from ``state<sep><index><sep><name>`` keys (``flatten_state``'s
    inverse; an index that is a number comes back as an int)."""
    states: dict = {}
    for key, v in flat.items():
        parts = key.split(sep, 2)
        if len(parts) != 3 or parts[0] != "state":
            raise ConfigError(f"{where}: {key!r} is not state{sep}<index>{sep}<name>; give "
                              f"the separator the file was written with")
        idx = int(parts[1]) if parts[1].lstrip("-").isdigit() else parts[1]
        states.setdefault(idx, {})[parts[2]] = v
    return states
