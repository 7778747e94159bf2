"""``python -m parallel_lab.checkpoint inspect|export`` (also ``parallel-lab checkpoint ...``).

    python -m parallel_lab.checkpoint inspect runs/<run>/checkpoints/step_00000100
    python -m parallel_lab.checkpoint export runs/<run>/checkpoints/step_00000100 out/ [--optimizer]
    python -m parallel_lab.checkpoint export runs/<run>/checkpoints/step_00000100 w.safetensors [--optimizer]

``inspect`` says who wrote a checkpoint (strategy, options, world size, step), its files and bytes
per rank, and what a run must keep to continue it with ``trainer.reshard=true``. ``export`` writes
the consolidated fp32 weights and, with ``--optimizer``, Adam's state (``<param>.exp_avg`` /
``.exp_avg_sq`` / ``.step``): an ``out`` ending in ``.safetensors`` is the weights' file, the
optimizer state going beside it as ``<stem>.optimizer.safetensors`` (``w.safetensors`` ->
``w.optimizer.safetensors``); any other ``out`` is a folder that gets ``model.safetensors`` and
``optimizer.safetensors``. Both only read files
(``full_state.py``: weights_only / allowlist unpicklers); bad input is one line and exit 2. Both
stream: ``inspect`` reads no tensor data, ``export`` one tensor at a time, into temporary files
renamed when complete (a failure leaves nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
from collections import defaultdict
from pathlib import Path

import torch

from parallel_lab.checkpoint.full_state import LazyState, consolidate, detect_format
from parallel_lab.checkpoint.manifest import COMPLETE, read_manifest
from parallel_lab.checkpoint.policy import COMPAT_KEYS, LAYOUT_KEYS
from parallel_lab.errors import ConfigError, one_line

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


SUFFIX = ".safetensors"


def export_targets(out: Path, optimizer: bool) -> tuple[Path, Path | None]:
    """Where export writes (weights, optimizer state or None): ``w.safetensors`` is the weights' file
    with ``w.optimizer.safetensors`` beside it; any other ``out`` is a folder holding
    ``model.safetensors`` and ``optimizer.safetensors``. Refuses a path that would overwrite anything."""
    if out.name.endswith(SUFFIX) and len(out.name) > len(SUFFIX):
        model, optim = out, out.with_name(out.name[: -len(SUFFIX)] + ".optimizer" + SUFFIX)
        taken = [f for f in (model, optim if optimizer else None) if f is not None and f.exists()]
        if taken:
            raise ConfigError(f"export target '{taken[0]}' exists; pass a new file name (or a folder)")
    else:
        model, optim = out / "model.safetensors", out / "optimizer.safetensors"
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"export folder '{out}' is not empty; pass a new or empty folder")
    return model, (optim if optimizer else None)


def _new_dirs(folder: Path) -> list[Path]:
    """The folders mkdir(parents=True) would create for ``folder``, deepest first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def export(path: Path, out: Path, optimizer: bool) -> list[Path]:
    """Write the weights (and the optimizer state) where ``export_targets`` says; returns the files
    written. Streamed: each file is written under a temporary name and renamed once complete, so a
    failure leaves nothing behind (folders it created included)."""
    manifest = read_manifest(path)
    full = consolidate(path, manifest=manifest)  # shapes checked; tensors are read while writing
    model_file, optim_file = export_targets(out, optimizer)
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


def _print_inspect(info: dict) -> None:
    print(f"{info['checkpoint']}")
    print(
        f"  written by strategy={info['strategy']} world_size={info['world_size']} at step {info['step']} "
        f"({info['format']} format; {info['parameters']:,} parameters, Adam state: {info['adam_state']})"
    )
    print(f"  options: {json.dumps(info['strategy_options'])}")
    for who, row in info["per_rank"].items():
        print(f"  {who:>8}: {row['files']} files, {row['bytes']:,} bytes")
    print(f"  total: {info['bytes']:,} bytes; {COMPLETE} checked")
    print(f"  reshard into: {info['reshard_into']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="who wrote a checkpoint, its files per rank, what it reshards into")
    p_inspect.add_argument("checkpoint", type=Path)
    p_inspect.add_argument("--json", action="store_true", help="print the same as JSON")
    p_export = sub.add_parser(
        "export",
        help="consolidated fp32 weights (and Adam state) as safetensors",
        description="Write a checkpoint's consolidated fp32 weights (and, with --optimizer, Adam's state) "
        "as safetensors; nothing is left behind on failure.",
    )
    p_export.add_argument("checkpoint", type=Path, help="a checkpoint folder (runs/<run>/checkpoints/step_N)")
    p_export.add_argument(
        "out",
        type=Path,
        help="a name ending in .safetensors is the weights' file (w.safetensors; the optimizer state goes "
        "beside it as w.optimizer.safetensors); anything else is a new or empty folder that gets "
        "model.safetensors (and optimizer.safetensors)",
    )
    p_export.add_argument(
        "--optimizer",
        action="store_true",
        help="also Adam's state: <out stem>.optimizer.safetensors, or optimizer.safetensors in the folder",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            info = inspect(args.checkpoint.expanduser())
            print(json.dumps(info, indent=1)) if args.json else _print_inspect(info)
        else:
            for file in export(args.checkpoint.expanduser(), args.out.expanduser(), args.optimizer):
                print(f"wrote {file} ({file.stat().st_size:,} bytes)")
    except ConfigError as exc:
        print(f"parallel_lab.checkpoint: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
