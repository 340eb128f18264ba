"""Reading DCP checkpoints without executing pickles, and only inside their directory.

DCP stores its ``.metadata`` as a pickle and non-tensor items with ``torch.save``. meshlab
writes tensors only (everything else goes to JSON), reads ``.metadata`` with an
unpickler that builds only DCP's own metadata classes and plain containers, and refuses
any checkpoint that carries pickled objects — unless the caller opts in with
``trust_pickles=True`` for a checkpoint they made themselves. Tensor shards are read by
DCP with ``torch.load(weights_only=True)``, which builds tensors and nothing else.

Whatever the unpickler built is then checked as data: every shard the metadata points
to must be a plain file of this directory (no ``..``, no absolute path, no link leading
out), carry no storage transform (meshlab writes none), and hold the byte range the
metadata claims; otherwise a crafted or damaged ``.metadata`` could make the load read
any file on the machine or fail deep inside DCP.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

from ..core.errors import ConfigError, MeshlabError, PeerError, RankMismatchError

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"),
}


class CheckpointError(MeshlabError, RuntimeError):
    """A checkpoint is missing, incomplete, damaged, unsafe, or does not fit the model."""


class CheckpointPeerError(CheckpointError, PeerError):
    """A checkpoint call failed on another rank; this rank raises too instead of waiting
    for it (the failed rank raises its own ``CheckpointError``)."""


class CheckpointMismatchError(CheckpointError, RankMismatchError):
    """The ranks entered different checkpoint calls, or passed different arguments."""


class CheckpointNamingError(CheckpointError):
    """A file names its tensors otherwise than the model does (a prefix, peft's renaming),
    so a load would match none of the model's weights, or would leave out some the file
    holds under another name."""


class CheckpointStepError(CheckpointError):
    """Parts of one resume (model, optimizer, scheduler) were saved at different steps."""


class AdapterConfigError(CheckpointError, ConfigError):
    """An adapter's saved config (``adapter_config.json``) differs from the model's LoRA
    config in a way that changes what the adapter computes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name in _TORCH_VALUES:
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not one of DCP's metadata "
            f"classes; it may carry code. meshlab refuses it. Load it only if you made it "
            f"yourself, with trust_pickles=True"
        )


_TORCH_VALUES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
                 "int8", "uint8", "bool", "strided", "contiguous_format", "preserve_format",
                 "channels_last", "float8_e4m3fn", "float8_e5m2", "complex64"}


def read_metadata_bytes(data: bytes, where: str):
    """DCP ``Metadata`` from the bytes of a ``.metadata`` file, built by the restricted
    unpickler; anything that is not well-formed metadata is a ``CheckpointError``."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as e:   # truncated or garbage bytes: UnpicklingError, EOFError, ...
        raise CheckpointError(
            f"{where} is damaged: it is not DCP metadata ({type(e).__name__}: {e}); the "
            f"checkpoint cannot be read. Load an older checkpoint (meshlab.checkpoint."
            f"latest lists the valid ones)") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointError(f"{where} is damaged: it unpickles to {type(md).__name__}, "
                              f"not DCP metadata with its storage table")
    return md


def check_storage(md, directory: str, sizes: dict[str, int] | None = None) -> None:
    """Every shard ``md`` points to is a plain file inside ``directory`` holding the byte
    range claimed; ``sizes`` (file name -> bytes, from the marker's checked list) also
    limits the shards to the files listed there."""
    real = os.path.realpath(directory)
    seen: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        what = f"{directory}/.metadata: the shard of {getattr(index, 'fqn', index)!r}"
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise CheckpointError(f"{what} lies at {name!r}, outside the checkpoint directory; "
                                  f"meshlab refuses to read it (a crafted or damaged .metadata)")
        full = os.path.join(directory, name)
        if not os.path.realpath(full).startswith(real + os.sep):
            raise CheckpointError(f"{what} is {full}, a link leading out of the checkpoint "
                                  f"directory; meshlab refuses to read it")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{what} names storage transforms "
                                  f"{info.transform_descriptors}; meshlab writes none and "
                                  f"refuses them")
        end = int(info.offset) + int(info.length)
        if int(info.offset) < 0 or int(info.length) < 0:
            raise CheckpointError(f"{what} has a negative offset or length; .metadata is damaged")
        seen[name] = max(seen.get(name, 0), end)
    for name, end in seen.items():
        if sizes is not None and name not in sizes:
            raise CheckpointError(f"{directory}/.metadata points to {name}, which is not one of "
                                  f"the files the checkpoint's marker lists; meshlab refuses "
                                  f"to read it (a crafted or damaged .metadata)")
        size = (sizes or {}).get(name)
        if size is None:
            try:
                size = os.path.getsize(os.path.join(directory, name))
            except OSError:
                raise CheckpointError(f"{directory}/{name} is missing: the checkpoint's "
                                      f".metadata points to it. The checkpoint is incomplete; "
                                      f"load an older one") from None
        if size < end:
            raise CheckpointError(f"{directory}/{name} is truncated: it has {size} bytes, the "
                                  f".metadata reads up to byte {end}. Load an older checkpoint")


def safe_reader(path: str, trust_pickles: bool = False, sizes: dict[str, int] | None = None):
    """A ``FileSystemReader`` whose metadata is read without running code and checked."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            where = str(self._get_metadata_path(kwargs.get("rank")))
            if trust_pickles:
                md = super().read_metadata(*args, **kwargs)
            else:
                with self.fs.create_stream(where, "rb") as f:
                    md = read_metadata_bytes(f.read(), where)
            check_storage(md, path, sizes)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            pickled = [k for k, v in md.state_dict_metadata.items()
                       if isinstance(v, BytesStorageMetadata)]
            if pickled and not trust_pickles:
                raise CheckpointError(
                    f"checkpoint {path} stores pickled objects ({pickled[:3]}); loading them "
                    f"would run code. meshlab refuses them; pass trust_pickles=True only for a "
                    f"checkpoint you made yourself")
            return md

    return _Reader(path)
