"""torch Distributed Checkpoint's file reader without unrestricted unpickling.

DCP's FileSystemReader reads tensors safely (``weights_only=True`` for byte items, raw storage for
tensors) but loads its ``.metadata`` file with plain ``pickle.load``, which runs whatever code a
tampered file names. This reader unpickles the metadata allowing only DCP's own metadata classes
and the torch/builtin types they hold.
"""
from __future__ import annotations

import pickle

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.storage import StorageMeta

# Exactly what torch 2.13's DCP writes into .metadata (FSDP1 and FSDP2, model + Adam state);
# every entry is a plain data class or a value lookup, none can run code.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
SAFE_GLOBALS = {
    (_DCP_METADATA, name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
} | {("torch", name) for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in a checkpoint's .metadata")


class WeightsOnlyFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = MetadataUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
