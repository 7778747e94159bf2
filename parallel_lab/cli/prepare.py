"""Write a validated ``<run_dir>/config.yaml`` without launching anything, for raw launcher commands:

    python -m parallel_lab.prepare <run_dir> [hydra overrides...]   # prints the config path

The same composition and validation as ``python -m parallel_lab``; a bad value is the same one-line
error. ``launch/run_ds.sh`` uses it, then starts the workers with the real ``deepspeed`` launcher.
"""

from __future__ import annotations

import sys
from pathlib import Path

from parallel_lab.config import compose_config, validate, write_run_config
from parallel_lab.errors import ConfigError


def prepare(run_dir: Path, overrides: list[str]) -> Path:
    """Compose, validate and write ``<run_dir>/config.yaml``; return its path."""
    from parallel_lab.cli.ds_args import overrides_from_deepspeed_args

    overrides = overrides_from_deepspeed_args(overrides)  # --deepspeed_config F: DeepSpeed's own flags too
    return write_run_config(validate(compose_config(overrides), run_dir, explicit=overrides))


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m parallel_lab.prepare <run_dir> [overrides...]", file=sys.stderr)
        return 2
    try:
        print(prepare(Path(argv[0]), argv[1:]))
    except ConfigError as exc:
        print(f"parallel_lab: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
