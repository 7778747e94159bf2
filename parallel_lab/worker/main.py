"""The worker entry point: one process of a run, whoever started it.

    python -m parallel_lab.worker <run_dir>/config.yaml [--local_rank N]

Started by our spawn launcher, ``torchrun -m parallel_lab.worker``, the ``deepspeed`` launcher
(which adds ``--local_rank``) or ``mpirun``. It reads only the resolved config file and the
environment (``parallel_lab.comm.dist_env``), never Hydra.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from parallel_lab.comm.dist_env import DistEnv, read_dist_env, read_rank
from parallel_lab.config import load_run_config
from parallel_lab.config.resources import pin_to_cores
from parallel_lab.errors import ConfigError, one_line
from parallel_lab.protocol import (
    ERRORS_DIR,
    METRICS_FILE,
    PIDS_DIR,
    SUPERVISED_ENV,
    RunMetrics,
    set_parent_death_signal,
)
from parallel_lab.strategies import get_strategy_class


def die_with_parent() -> None:
    """If the launching parent dies, this worker gets SIGKILL: no orphans."""
    if os.environ.get(SUPERVISED_ENV):
        set_parent_death_signal(signal.SIGKILL)


def report_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Leave the traceback where the launcher finds it (errors/rank<k>.txt) and say one line."""
    text = traceback.format_exc()
    first_line = one_line(str(exc)) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {one_line(str(exc))}"
    errors = run_dir / ERRORS_DIR
    errors.mkdir(parents=True, exist_ok=True)
    kind = "config" if isinstance(exc, ConfigError) else "exception"
    (errors / f"rank{rank}.txt").write_text(f"{time.time():.6f} {kind}\n{first_line}\n{text}")
    if not os.environ.get(SUPERVISED_ENV):
        print(f"[rank {rank}] {text}", file=sys.stderr, end="")
    elif kind == "config":
        return  # our launcher prints this one line itself, once
    print(f"[rank {rank}] failed: {first_line}", file=sys.stderr, flush=True)


def close_cleanly(strategy) -> None:
    """The clean-exit recipe (docs/facts.md): plain destroy_process_group() aborts gloo at
    exit about 40% of the time; dropping every model/optimizer reference, collecting garbage and
    meeting at a barrier first made it 0 in 30+ runs."""
    import torch.distributed as dist

    if strategy is not None:
        strategy.teardown()
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def record_pid(run_dir: Path, rank: int) -> None:
    """<run_dir>/pids/rank<k>.pid: lets anyone check, by pid, that no worker outlived its run."""
    folder = run_dir / PIDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")


def adapt_to_elastic_world(cfg, env: DistEnv) -> None:
    """launcher.min_nodes: torchrun may start this attempt with fewer (or again more) ranks than
    config.yaml names. The run goes on at the world it got: the same global batch (each rank a
    larger share, so the loss curve continues), and whatever checkpoint it resumes is re-cut to this
    world (trainer.reshard: exact, tests/integration/test_reshard.py)."""
    nproc = cfg.launcher.nproc_per_node or 1
    if env.world_size % nproc or cfg.trainer.global_batch % (env.world_size * cfg.trainer.grad_accum):
        raise ConfigError(
            f"torchrun re-formed the group with {env.world_size} ranks, which do not split "
            f"trainer.global_batch={cfg.trainer.global_batch}; pick a global batch every allowed world size divides"
        )
    cfg.world_size = env.world_size
    cfg.launcher.nodes = env.world_size // nproc
    cfg.trainer.reshard = True


def run_worker(config_path: str) -> RunMetrics:
    """Train one rank of the run described by config_path; rank 0 writes metrics.json."""
    from parallel_lab.worker.train import train

    cfg = load_run_config(config_path)
    env: DistEnv = read_dist_env(cfg.device)
    if cfg.launcher.get("min_nodes") is not None:
        adapt_to_elastic_world(cfg, env)
    if env.world_size != cfg.world_size:
        raise ConfigError(
            f"config.yaml was resolved for world_size={cfg.world_size} but the launcher started "
            f"{env.world_size} processes; start {cfg.world_size} (e.g. --nproc_per_node {cfg.world_size})"
        )
    if cfg.trainer.pin_cores and env.device.type == "cpu":
        pin_to_cores(env.local_rank, cfg.trainer.threads)  # first: the threads started below inherit it
    torch.set_num_threads(cfg.trainer.threads)
    strategy_cls = get_strategy_class(cfg.strategy.name)
    strategy = None
    if strategy_cls.plan.needs_process_group:
        strategy_cls.init_distributed(env, cfg.dist_timeout_s)
    try:
        strategy = strategy_cls(cfg, env)
        metrics = train(cfg, env, strategy)
        if env.is_main:
            metrics.write(Path(cfg.run_dir) / METRICS_FILE)
        return metrics
    finally:
        # Only on success: after an exception peers may be gone and a barrier would hang.
        if sys.exc_info()[0] is None:
            close_cleanly(strategy)
        del strategy


def leave_imports_out_of_collections() -> None:
    """Freeze every object alive now (modules, functions, torch's op tables: ~300k once torch and
    its compiler are imported) into the collector's permanent generation, and collect from here on.
    They live as long as the rank, yet each full collection would walk them all again: close_cleanly's
    gc.collect() alone costs 0.18 s per rank without this and nothing with it (measured). A forked
    rank inherits the zygote's objects and freezes them the same way. ``python -m
    parallel_lab.worker`` keeps the collector off while it imports, for the same reason."""
    gc.freeze()
    gc.enable()


def main(argv: list[str] | None = None) -> int:
    leave_imports_out_of_collections()
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.worker")
    parser.add_argument("config", help="<run_dir>/config.yaml written by `python -m parallel_lab`")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    die_with_parent()
    record_pid(Path(args.config).resolve().parent, read_rank(os.environ)[0])
    try:
        run_worker(args.config)
    except BaseException as exc:  # every failure must end this rank, loudly, now
        rank = read_rank(os.environ)[0]
        run_dir = Path(args.config).resolve().parent
        report_failure(run_dir, rank, exc)
        sys.stdout.flush()
        # os._exit: skip interpreter teardown, where gloo's destructors can hang on dead peers.
        os._exit(2 if isinstance(exc, ConfigError) else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
