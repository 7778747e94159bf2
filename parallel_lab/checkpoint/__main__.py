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
import sys
from pathlib import Path

from parallel_lab.checkpoint.manifest import COMPLETE, read_manifest
from parallel_lab.errors import ConfigError, one_line

# What reads tensors lives in parallel_lab.checkpoint.export and is imported once the arguments,
# the manifest and the export targets have passed: --help and those refusals take no torch import
# (about 4 s of CPU here).

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
        if args.command == "export":  # refused before torch loads: a missing checkpoint, a taken target
            read_manifest(args.checkpoint.expanduser())
            targets = export_targets(args.out.expanduser(), args.optimizer)
        from parallel_lab.checkpoint.export import export, inspect

        if args.command == "inspect":
            info = inspect(args.checkpoint.expanduser())
            print(json.dumps(info, indent=1)) if args.json else _print_inspect(info)
        else:
            for file in export(args.checkpoint.expanduser(), targets):
                print(f"wrote {file} ({file.stat().st_size:,} bytes)")
    except ConfigError as exc:
        print(f"parallel_lab.checkpoint: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
