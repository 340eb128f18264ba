"""The commit marker ``meshlab.json`` and the checksums of a checkpoint's files.

The marker lists every file of the checkpoint with its size and SHA-256 (``files``).
Each rank hashes the shards it wrote; rank 0 adds ``.metadata`` and the per-rank files
before it writes the marker. On load every rank checks that every file is present and
of its size, and hashes its share of them (plus ``.metadata`` and its own RNG file,
which it reads itself), so a truncated, missing, swapped or bit-flipped file is named
before anything is read into the model. The marker checksums itself too (``digest``: the
SHA-256 of its canonical JSON without that field), so an edited or damaged marker — a
learning rate changed in place — is refused rather than loaded.

A save also records what it knows of the step's health (``health``: the loss the caller
passed in ``extra['loss']`` and the optimizer's last gradient norm); ``latest`` passes
over a checkpoint whose recorded loss or norm is not finite.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from typing import Any

from ._safe import CheckpointError

MARKER = "meshlab.json"
FORMAT = "meshlab.checkpoint/3"
UNSEALED = "meshlab.checkpoint/2"      # written before the marker checksummed itself
LEGACY = "meshlab.checkpoint/1"        # written before checksums: loaded unverified
DIGEST = "digest"
_CHUNK = 1 << 22


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


def entry(path: str) -> dict:
    """What the marker records of one file."""
    return {"bytes": os.path.getsize(path), "sha256": sha256(path)}


def canonical_digest(doc: dict) -> str:
    """The SHA-256 of ``doc``'s canonical JSON (sorted keys, no spaces), ``digest`` left
    out: what ``seal`` records and ``check_digest`` compares."""
    body = {k: v for k, v in doc.items() if k != DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def seal(doc: dict) -> dict:
    """``doc`` with its own checksum (``digest``), as markers and manifests are written."""
    return {**doc, DIGEST: canonical_digest(doc)}


def check_digest(doc: dict, where: str) -> None:
    """A ``CheckpointError`` naming ``where`` unless ``doc`` carries the checksum of its
    own content."""
    got = doc.get(DIGEST)
    if not isinstance(got, str):
        raise CheckpointError(f"{where} is damaged: it carries no checksum of its own "
                              f"content ({DIGEST!r}); load an older checkpoint")
    if got != canonical_digest(doc):
        raise CheckpointError(f"{where} is damaged: its content differs from the SHA-256 "
                              f"recorded in it (edited, or flipped bits); load an older "
                              f"checkpoint")


def rank_file(r: int) -> str:
    return f"rank-{r:05d}.json"


def shard_prefix(r: int) -> str:
    """DCP names the files rank ``r`` of its group writes ``__<r>_<n>.distcp``."""
    return f"__{r}_"


def is_complete(path: str) -> bool:
    """Whether directory ``path`` carries a commit marker (a complete checkpoint)."""
    return os.path.isfile(os.path.join(path, MARKER))


def read_marker(path: str) -> dict:
    """The marker of checkpoint directory ``path``, checked; a ``CheckpointError``
    naming the file and the damage if it is unreadable or malformed."""
    where = os.path.join(path, MARKER)
    try:
        with open(where, "rb") as f:
            meta = json.loads(f.read().decode())
    except FileNotFoundError:
        hint = " (an interrupted save: no commit marker)" if os.path.isdir(path) else ""
        raise CheckpointError(f"{path} is not a complete meshlab checkpoint{hint}; use "
                              f"meshlab.checkpoint.latest(dir) to find the newest valid one"
                              ) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where} is damaged: not a JSON document ({e}); this "
                              f"checkpoint cannot be used, load an older one") from None
    _check_marker(meta, where)
    if meta["format"] == FORMAT:
        check_digest(meta, where)
    elif meta["format"] == UNSEALED:
        warnings.warn(f"{where} was written before meshlab checksummed its marker: the "
                      f"marker itself cannot be verified", stacklevel=3)
    return meta


def _check_marker(meta: Any, where: str) -> None:
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} is damaged: it holds a JSON {type(meta).__name__}, "
                              f"not the object meshlab writes; load an older checkpoint")
    fmt = meta.get("format")
    if fmt not in (FORMAT, UNSEALED, LEGACY):
        raise CheckpointError(f"{where}: format {fmt!r}, expected {FORMAT!r}; this is not a "
                              f"meshlab checkpoint, or one from a newer meshlab")
    bad = []
    if meta.get("extra") is not None and not isinstance(meta["extra"], dict):
        bad.append(f"extra is a {type(meta['extra']).__name__}, not an object")
    t = meta.get("time", 0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        bad.append(f"time is {t!r}, not a number")
    ws = meta.get("world_size")
    if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws < 1):
        bad.append(f"world_size is {ws!r}")
    for key in ("optimizer", "mesh", "scheduler", "dataloader", "health"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            bad.append(f"{key} is a {type(meta[key]).__name__}, not an object")
    for key, v in (meta.get("health") or {}).items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            bad.append(f"health.{key} is {v!r}, not a number")
    if fmt != LEGACY:
        bad += _check_files(meta.get("files"))
    if bad:
        raise CheckpointError(f"{where} is damaged: {'; '.join(bad)}; load an older checkpoint")


def _check_files(files: Any) -> list[str]:
    if not isinstance(files, dict) or not files:
        return ["it lists no files with checksums"]
    for name, e in files.items():
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            return [f"it lists the file {name!r}, which is not a name inside the directory"]
        if not (isinstance(e, dict) and isinstance(e.get("sha256"), str)
                and isinstance(e.get("bytes"), int) and not isinstance(e.get("bytes"), bool)):
            return [f"its entry for {name} is {e!r}, not a size and a SHA-256"]
    return []


def order_key(meta: dict) -> tuple:
    """Newest first by ``extra['step']`` (when a finite number), then by save time."""
    step = (meta.get("extra") or {}).get("step")
    ok = isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
    return (step if ok else -1, meta.get("time", 0))


def unhealthy(meta: dict) -> str | None:
    """Why a checkpoint is no place to resume from (a non-finite loss, gradient norm or
    step was recorded with it), or None."""
    step = (meta.get("extra") or {}).get("step")
    if isinstance(step, float) and not math.isfinite(step):
        return f"its extra['step'] is {step}"
    for key, v in sorted((meta.get("health") or {}).items()):
        if isinstance(v, (int, float)) and not math.isfinite(v):
            return f"its recorded {key.replace('_', ' ')} is {v}"
    return None


def checked(path: str) -> dict | None:
    """The marker of ``path``, or None with a warning when it is damaged."""
    try:
        return read_marker(path)
    except CheckpointError as e:
        warnings.warn(f"skipping {path}: {e}", stacklevel=3)
        return None


def verify(path: str, files: dict, mine: list[str]) -> dict[str, int]:
    """Every file listed is present with its size; those in ``mine`` also match their
    SHA-256. Returns name -> size. Raises a ``CheckpointError`` naming the file."""
    sizes = {}
    for name, e in sorted(files.items()):
        full = os.path.join(path, name)
        try:
            size = os.path.getsize(full)
        except OSError:
            raise CheckpointError(f"{full} is missing: the checkpoint lists it "
                                  f"({e['bytes']} bytes). The checkpoint is incomplete; load an "
                                  f"older one") from None
        if size != e["bytes"]:
            damage = "truncated" if size < e["bytes"] else "longer than written"
            raise CheckpointError(f"{full} is {damage}: it has {size} bytes, the checkpoint "
                                  f"wrote {e['bytes']}. Load an older checkpoint")
        sizes[name] = size
    for name in mine:
        full = os.path.join(path, name)
        if sha256(full) != files[name]["sha256"]:
            raise CheckpointError(f"{full} is damaged: its SHA-256 differs from the one "
                                  f"recorded when it was written (flipped bits or a file "
                                  f"swapped with another). Load an older checkpoint")
    return sizes
