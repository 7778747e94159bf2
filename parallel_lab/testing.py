"""Helpers to run the real thing from tests and benchmarks.

- :func:`run_cli` / :func:`run_cli_metrics`: one ``python -m parallel_lab`` run in a subprocess,
  and what it measured (the one place tests and benchmarks start the command line).
- :func:`run_ranks`: a distributed test body, a plain importable function ``fn(rank, world_size,
  **kwargs)``, on N fresh processes with a gloo group on 127.0.0.1 (Accelerate-style); the same
  function runs under any real launcher via ``python -m parallel_lab.testing module:function
  '{"kw": 1}'``. On failure every rank's stderr is shown, and every process is gone when it returns.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from parallel_lab.protocol import METRICS_FILE, RunMetrics
from parallel_lab.worker.dist_env import free_port, read_dist_env

CLI_TIMEOUT = 420  # seconds; generous for 2 shared cores, still ends a hung run


class CLIFailed(RuntimeError):
    """A ``python -m parallel_lab`` run that was expected to succeed exited non-zero."""


def run_cli(
    run_dir: Path,
    *overrides: str,
    timeout: float = CLI_TIMEOUT,
    env: dict | None = None,
    check: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m parallel_lab hydra.run.dir=<run_dir> trainer.progress=false <overrides>``."""
    cmd = [sys.executable, "-m", "parallel_lab", f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides]
    result = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if check and result.returncode != 0:
        raise CLIFailed(
            f"{' '.join(cmd)} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def load_metrics(run_dir: Path) -> dict:
    """A run's metrics.json, read as the record it is (a missing or malformed field fails here)."""
    return RunMetrics.read(Path(run_dir) / METRICS_FILE).to_json()


def run_cli_metrics(run_dir: Path, *overrides: str, **kwargs) -> dict:
    """run_cli, then the metrics it wrote."""
    run_cli(run_dir, *overrides, **kwargs)
    return load_metrics(run_dir)


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run_ranks(target: str, world_size: int, timeout: float = 120, env: dict | None = None, **kwargs) -> list[str]:
    """Run ``target`` on ``world_size`` gloo ranks; return each rank's stdout; raise with all
    ranks' stderr if any rank fails or the timeout passes (every rank is killed then)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ, **(env or {}))
        rank_env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, "-m", "parallel_lab.testing", target, json.dumps(kwargs)]
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs, failed = [], False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
            err += f"\n[timed out after {timeout} s]"
            proc.returncode = proc.returncode or -9
        outputs.append((out, err, proc.returncode))
        failed |= proc.returncode != 0
    if failed:
        report = "\n".join(f"--- rank {r} (exit {c}) stderr ---\n{e}" for r, (_, e, c) in enumerate(outputs))
        raise AssertionError(f"{target} failed on {world_size} ranks:\n{report}")
    return [out for out, _, _ in outputs]


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    target, kwargs = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    env = read_dist_env("cpu")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        _resolve(target)(env.rank, env.world_size, **kwargs)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # peers may be gone: skip gloo teardown, which could hang
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
