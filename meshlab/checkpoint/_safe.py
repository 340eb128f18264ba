"""Reading DCP checkpoints without executing pickles.

DCP stores its ``.metadata`` as a pickle and non-tensor items with ``torch.save``. meshlab
writes tensors only (everything else goes to JSON), reads ``.metadata`` with an
unpickler that builds only DCP's own metadata classes and plain containers, and refuses
any checkpoint that carries pickled objects — unless the caller opts in with
``trust_pickles=True`` for a checkpoint they made themselves.
"""

from __future__ import annotations

import pickle
from typing import Any

from .._errors import MeshlabError

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
    """A checkpoint is missing, incomplete, unsafe, or does not fit the model."""


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


def safe_reader(path: str, trust_pickles: bool = False):
    """A ``FileSystemReader`` whose metadata is read without running code."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if trust_pickles:
                return super().read_metadata(*args, **kwargs)
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                md = _MetadataUnpickler(f).load()
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            pickled = [k for k, v in md.state_dict_metadata.items()
                       if isinstance(v, BytesStorageMetadata)]
            if pickled:
                raise CheckpointError(
                    f"checkpoint {path} stores pickled objects ({pickled[:3]}); loading them "
                    f"would run code. meshlab refuses them; pass trust_pickles=True only for a "
                    f"checkpoint you made yourself")
            return md

    return _Reader(path)
