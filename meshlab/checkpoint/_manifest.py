"""The checksum manifest of an export (a Hugging Face model, a PEFT adapter).

An export meshlab writes carries ``meshlab.manifest.json``: the size and SHA-256 of every
other file of the directory, what the caller records with it (``extra``: the Booster's
step), and the SHA-256 of its own canonical content (``digest``, as the checkpoint
marker). transformers and peft ignore the file; meshlab's readers verify every listed file
against it before reading a weight, so a flipped bit, a truncated shard or a file swapped
in from another export is named instead of loaded. A directory without a manifest (an
export transformers or peft wrote) is read unverified, as those libraries read it.
"""

from __future__ import annotations

import json
import os

from ._commit import write_json
from ._files import check_digest, entry, seal, verify
from ._safe import CheckpointError

MANIFEST = "meshlab.manifest.json"
FORMAT = "meshlab.manifest/1"


def write(directory: str, extra: dict | None = None, quantized: dict | None = None) -> None:
    """List every file of ``directory`` (but the manifest) with its checksum, and a 4-bit
    base's quantization (``_fourbit.record``) where the export holds one."""
    files = {n: entry(os.path.join(directory, n)) for n in sorted(os.listdir(directory))
             if n != MANIFEST and not n.endswith(".tmp")
             and os.path.isfile(os.path.join(directory, n))}
    doc = {"format": FORMAT, "files": files}
    if extra is not None:
        doc["extra"] = extra
    if quantized:
        doc["quantized"] = quantized
    write_json(os.path.join(directory, MANIFEST), seal(doc))


def read(directory: str) -> dict | None:
    """The checked manifest of ``directory``, or None where there is none."""
    where = os.path.join(directory, MANIFEST)
    try:
        with open(where, "rb") as f:
            doc = json.loads(f.read().decode())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where} is damaged: not a JSON document ({e}); export "
                              f"again") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a meshlab manifest ({FORMAT}); export again")
    check_digest(doc, where)
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(n, str) and os.path.basename(n) == n and n not in ("", ".", "..")
            and isinstance(e, dict) and isinstance(e.get("sha256"), str)
            and isinstance(e.get("bytes"), int) for n, e in files.items()):
        raise CheckpointError(f"{where} is damaged: its file list is not names inside "
                              f"{directory} with sizes and SHA-256s; export again")
    for key in ("extra", "quantized"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise CheckpointError(f"{where} is damaged: {key} is not an object; export again")
    return doc


def check(directory: str, share: tuple[int, int] = (0, 1)) -> dict | None:
    """Verify ``directory`` against its manifest: every listed file present with its size,
    those of this rank's ``share`` (rank, ranks) hashed. Returns the manifest (None for a
    foreign export); a damaged file is a ``CheckpointError`` naming it."""
    doc = read(directory)
    if doc is None:
        return None
    names = sorted(doc["files"])
    verify(directory, doc["files"], names[share[0]::share[1]])
    return doc


def listed(doc: dict | None, directory: str, name: str) -> None:
    """A file a reader opens must be one the manifest lists (where there is one)."""
    if doc is not None and name not in doc["files"]:
        raise CheckpointError(f"{os.path.join(directory, name)} is not one of the files "
                              f"{MANIFEST} lists; meshlab refuses to read it (a file added "
                              f"after the export). Export again")
