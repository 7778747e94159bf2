"""torch Distributed Checkpoint loading without unrestricted unpickling.

DCP (torch 2.13) unpickles in two places with no restriction: ``FileSystemReader.read_metadata``
(``pickle.load`` of ``.metadata``) and ``DefaultLoadPlanner.load_bytes`` (``torch.load(...,
weights_only=False)`` of every non-tensor entry, e.g. the optimizer's lr and betas). Either would
run whatever code a tampered file names. ``load_sharded`` closes both: the metadata is unpickled
allowing only DCP's own metadata classes, byte entries are read with ``weights_only=True``.
Tensors are raw storage either way.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.storage import StorageMeta

# Exactly what torch 2.13's DCP writes into .metadata (FSDP1 and FSDP2, model + Adam state);
# every entry is a plain data class or a value lookup, none can run code.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
SAFE_GLOBALS = (
    {
        (_DCP_METADATA, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
    }
    | {("torch", name) for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")}
)


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


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        checked = torch.load(value, weights_only=True)  # refuses any global outside torch's allowlist
        # Hand DCP the checked value re-serialised: its own (unrestricted) load now sees only
        # plain values and tensors, and it stays in charge of where the value goes.
        clean = io.BytesIO()
        torch.save(checked, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def read_tensor(folder, fqn: str, metadata) -> torch.Tensor:
    """One tensor of a DCP checkpoint by its flattened name (``model.fc.weight``,
    ``optimizer.state.fc.weight.exp_avg``), whole, without a process group: DCP reads only the
    byte ranges of that tensor's chunks from the .distcp files."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    meta = metadata.state_dict_metadata[fqn]
    state = {fqn: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
    _load_state_dict(
        state,
        storage_reader=WeightsOnlyFileSystemReader(str(folder)),
        planner=WeightsOnlyLoadPlanner(flatten_state_dict=False),
        no_dist=True,
    )
    return state[fqn]


def load_sharded(state: dict, path: str) -> None:
    """dcp.load(state) from the folder path, in place, with both restrictions."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from parallel_lab.checkpoint.manifest import CheckpointError
    from parallel_lab.errors import one_line

    try:
        dcp.load(state, storage_reader=WeightsOnlyFileSystemReader(path), planner=WeightsOnlyLoadPlanner())
    except CheckpointException as exc:  # a BaseException carrying every rank's traceback: keep the cause
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        reason = one_line(str(causes[0]))[:400] if causes else "unknown error"
        raise CheckpointError(
            f"checkpoint '{path}' cannot be loaded: {reason}; trainer.resume=never to start fresh"
        ) from None
