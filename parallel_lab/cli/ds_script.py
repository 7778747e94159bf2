"""The Python half of ``launch/run_ds.sh``: what each rank runs under ``deepspeed launch/run_ds.sh``.

The ``deepspeed`` launcher starts ``python -u launch/run_ds.sh --local_rank=N [args...]`` once per
rank, with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and nothing of ours runs
before that. So the file is a bash/Python polyglot, and here, per rank:

* rank 0 is the parent: it composes and validates the config from the overrides (and DeepSpeed's
  own ``--deepspeed_config``/``--deepspeed`` flags) exactly as ``python -m parallel_lab`` does, and
  writes ``<run_dir>/config.yaml`` atomically; a bad value is the same one line and exit 2, written
  to ``failed.json`` before any process group exists;
* the other ranks wait for that file (or for ``failed.json``: they then exit 2 quietly), and
* every rank runs the worker on the file, as under any other launcher. Workers never run Hydra.

All ranks must agree on the run folder without talking: ``RUN_DIR`` if set, else
``runs/ds/<start time of the launcher process>_<its pid>``: the ranks' common parent is DeepSpeed's
per-node launcher. ``world_size`` defaults to the launcher's WORLD_SIZE (plain ``deepspeed x``
starts one rank on CPU; ``--num_gpus N`` N ranks).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from parallel_lab.errors import ConfigError, one_line

REPO = Path(__file__).resolve().parents[2]
WAIT_FOR_CONFIG_S = 300.0  # rank 0 composes + validates (a DeepSpeed import included): seconds, not minutes


def _launcher_stamp() -> str:
    """<start time>_<pid> of this rank's parent (DeepSpeed's launcher): the same on every local rank."""
    ppid = os.getppid()
    try:
        ticks = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        started = 0.0  # not Linux: the pid alone still keeps concurrent runs apart
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S', time.localtime(started))}_{ppid}"


def run_dir_for_ranks() -> Path:
    return Path(os.environ.get("RUN_DIR") or f"runs/ds/{_launcher_stamp()}")


def prepare_as_parent(run_dir: Path, overrides: list[str]) -> Path:
    """Rank 0: the parent's composition and validation; config.yaml appears whole or not at all."""
    from parallel_lab.cli.ds_args import overrides_from_deepspeed_args
    from parallel_lab.config import compose_config, validate, write_run_config

    world = os.environ.get("WORLD_SIZE", "1")
    overrides = ["launcher=deepspeed", f"world_size={world}", *overrides_from_deepspeed_args(overrides)]
    return write_run_config(validate(compose_config(overrides), run_dir, explicit=overrides[2:]))


def wait_for_config(run_dir: Path, timeout_s: float = WAIT_FOR_CONFIG_S) -> Path | None:
    """Ranks > 0: the config rank 0 wrote, or None if rank 0 refused the input."""
    from parallel_lab.protocol import CONFIG_FILE, FAILED_FILE

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / CONFIG_FILE).is_file():
            return run_dir / CONFIG_FILE
        if (run_dir / FAILED_FILE).is_file():
            return None
        time.sleep(0.05)
    raise TimeoutError(f"rank 0 wrote no {run_dir / CONFIG_FILE} within {timeout_s:.0f} s")


def _refuse(run_dir: Path, message: str) -> int:
    from parallel_lab.protocol import FAILED_FILE, FailedRun

    run_dir.mkdir(parents=True, exist_ok=True)
    FailedRun(strategy=None, launcher="deepspeed", world_size=None, model=None, error=message).write(
        run_dir / FAILED_FILE
    )
    print(f"parallel_lab: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str]) -> int:
    from parallel_lab.cli.ds_args import split_deepspeed_args

    os.chdir(REPO)  # as the bash half does: runs/ lands in the checkout
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the deepspeed launcher does not set it
    args, _ = split_deepspeed_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    rank = int(os.environ.get("RANK", "0"))
    run_dir = run_dir_for_ranks().resolve()
    local_rank_flag = [] if args.local_rank is None else [f"--local_rank={args.local_rank}"]
    overrides = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    if rank == 0:
        try:
            config = prepare_as_parent(run_dir, overrides)
        except ConfigError as exc:
            return _refuse(run_dir, one_line(str(exc)))
    else:
        config = wait_for_config(run_dir)
        if config is None:
            return 2  # rank 0 said why, once
    from parallel_lab.worker.main import main as worker_main

    code = worker_main([str(config), *local_rank_flag])
    if rank == 0 and code == 0:
        from parallel_lab.protocol import METRICS_FILE
        from parallel_lab.report.table import summary_line

        print(summary_line(run_dir / METRICS_FILE), flush=True)
    return code
