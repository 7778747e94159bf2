"""Helpers to run distributed code for real in tests and examples (Accelerate-style).

A distributed test body is a plain importable function ``fn(rank, world_size, **kwargs)``. The
same function runs under :func:`run_ranks` (N fresh processes with a gloo group on 127.0.0.1) or
under any real launcher via ``python -m parallel_lab.testing module:function '{"kw": 1}'``.
On failure every rank's stderr is shown, and every process is gone when it returns.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from datetime import timedelta

from parallel_lab.worker.dist_env import free_port, read_dist_env


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
        rank_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
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
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=60))
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
