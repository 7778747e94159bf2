"""What ``python -m parallel_lab.checkpoint`` does (:mod:`parallel_lab.checkpoint.__main__`):
``inspect`` a checkpoint, ``export`` its consolidated state as safetensors. Apart from the command
line so that the command refuses bad arguments, and prints its help, before torch is imported."""

from __future__ import annotations

import json
import math
import re
import struct
from collections import defaultdict
from pathlib import Path

import torch

from parallel_lab.checkpoint.full_state import LazyState, consolidate, detect_format
from parallel_lab.checkpoint.manifest import read_manifest
from parallel_lab.checkpoint.policy import COMPAT_KEYS, LAYOUT_KEYS
from parallel_lab.errors import ConfigError

# Which rank wrote a file, from its name: trainer_rank1.pt, shard_rank1.pt, __1_0.distcp, zero_pp_rank_1_...
_RANK = re.compile(r"(?:rank_?|^__)(\d+)")


def files_per_rank(path: Path, manifest: dict) -> dict[str, dict]:
    """{"rank <k>" | "shared": {"files": n, "bytes": b}} from complete.json's file list."""
    table: dict[str, dict] = defaultdict(lambda: {"files": 0, "bytes": 0})
    for rel, info in manifest["files"].items():
        found = _RANK.search(Path(rel).name)
        row = table[f"rank {found[1]}" if found else "shared"]
        row["files"] += 1
        row["bytes"] += info["size"]
    return dict(sorted(table.items()))


def inspect(path: Path) -> dict:
    """What the checkpoint is, from complete.json and the files (nothing is unpickled but the
    trainer files, with weights_only)."""
    manifest = read_manifest(path)
    full = consolidate(path, manifest=manifest)
    run = manifest.get("run", {})
    keep = {k: run.get(k) for k in COMPAT_KEYS if k not in LAYOUT_KEYS}
    return {
        "checkpoint": str(path),
        "strategy": run.get("strategy"),
        "strategy_options": run.get("strategy_options"),
        "world_size": run.get("world_size"),
        "step": manifest["step"],
        "batches_consumed": full.batches_consumed,
        "format": detect_format(path),
        "parameters": sum(math.prod(full.model.shapes[n]) for n in full.param_names),
        "adam_state": bool(full.optim),
        "bytes": sum(f["size"] for f in manifest["files"].values()),
        "per_rank": files_per_rank(path, manifest),
        "reshard_into": "any strategy and world size, with trainer.reshard=true and the same "
        + " ".join(f"{k}={v}" for k, v in keep.items()),
    }


# safetensors' dtype names (its format spec); the tensors a checkpoint of ours can hold.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(file: Path, state: LazyState, metadata: dict[str, str]) -> None:
    """A .safetensors file written tensor by tensor: the header (names, dtypes, shapes, byte
    offsets) comes from ``state.meta`` alone, then each tensor is read, written and dropped, so
    only one is in memory at a time (``safetensors.torch.save_file`` needs them all at once).
    The format: an 8-byte little-endian header length, the JSON header padded with spaces to a
    multiple of 8, then the tensors' bytes back to back in header order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, meta in state.meta.items():
        nbytes = math.prod(meta.shape) * meta.dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[meta.dtype],
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with file.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, meta in state.meta.items():
            tensor = state[name].contiguous()
            if tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
                raise ConfigError(f"{name} reads as {tensor.dtype} {tuple(tensor.shape)}, its metadata says {meta}")
            out.write(memoryview(tensor.view(-1).view(torch.uint8).numpy()))  # no copy


def _optimizer_view(full) -> LazyState:
    """Adam's state as one flat LazyState named ``<param>.exp_avg`` / ``.exp_avg_sq`` / ``.step``."""
    meta = {f"{n}.{k}": m for n, state in full.optim.items() for k, m in state.meta.items()}
    return LazyState(meta, lambda key: full.optim[key.rpartition(".")[0]][key.rpartition(".")[2]])


def _new_dirs(folder: Path) -> list[Path]:
    """The folders mkdir(parents=True) would create for ``folder``, deepest first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def export(path: Path, targets: tuple[Path, Path | None]) -> list[Path]:
    """Write the weights (and the optimizer state, unless its target is None) to ``targets``
    (``parallel_lab.checkpoint.__main__.export_targets``); returns the files written. Streamed: each
    file is written under a temporary name and renamed once complete, so a failure leaves nothing
    behind (folders it created included)."""
    manifest = read_manifest(path)
    full = consolidate(path, manifest=manifest)  # shapes checked; tensors are read while writing
    model_file, optim_file = targets
    meta = {"step": str(full.step), "source": str(path), "format": full.format}
    jobs = [(model_file, full.model)] + ([(optim_file, _optimizer_view(full))] if optim_file else [])
    created = _new_dirs(model_file.parent)
    model_file.parent.mkdir(parents=True, exist_ok=True)
    partial = [file.with_name(f".{file.name}.partial") for file, _ in jobs]
    try:
        for (file, state), tmp in zip(jobs, partial):
            write_safetensors(tmp, state, meta)
    except BaseException:
        for tmp in partial:
            tmp.unlink(missing_ok=True)
        for folder in created:
            folder.rmdir()
        raise
    for (file, _), tmp in zip(jobs, partial):
        tmp.rename(file)
    return [file for file, _ in jobs]
