"""Distributed test body: many whole runs (any strategy) trained in turn on ONE set of real gloo
ranks, through the worker's own steps (the strategy's init_distributed, which adopts the existing
group as DeepSpeed does, then the generic train loop); rank 0 writes each run's metrics.json and
final_params.pt as a worker would. Used by the sharded matrix (tests/integration/test_sharded.py) and the
uninterrupted runs that resumed ones must equal bitwise (tests/integration/test_checkpoint.py): one process
start-up (and one DeepSpeed import) per rank instead of one per run."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path

import torch

from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.config import load_run_config
from parallel_lab.protocol import METRICS_FILE
from parallel_lab.strategies import get_strategy_class
from parallel_lab.worker.train import train


def record_run(config_path: str, strategy_cls: type | None = None, after: Callable | None = None) -> None:
    """One whole run as a worker does it (strategy_cls: the config's own strategy unless given;
    after(cfg, strategy): called on every rank once it trained, before the teardown)."""
    cfg = load_run_config(config_path)
    env = read_dist_env(cfg.device)
    torch.set_num_threads(cfg.trainer.threads)
    strategy_cls = strategy_cls or get_strategy_class(cfg.strategy.name)
    strategy_cls.init_distributed(env, cfg.dist_timeout_s)
    strategy = strategy_cls(cfg, env)
    metrics = train(cfg, env, strategy)
    if env.is_main:
        metrics.write(Path(cfg.run_dir) / METRICS_FILE)
    if after is not None:
        after(cfg, strategy)
    strategy.teardown()
    del strategy, metrics
    gc.collect()  # the clean-exit recipe (docs/facts.md): no model state alive between runs


def train_and_record(rank: int, world_size: int, config_paths: list[str]) -> None:
    for path in config_paths:
        record_run(path)


def train_and_watch_linear(rank: int, world_size: int, config_paths: list[str]) -> None:
    """train_and_record, noting after each run (torn down) whether torch.nn.functional.linear is
    still the function it was before the first: ZeRO-3 swaps it for the process unless its teardown
    puts it back (zero/strategy.py restore_functional_linear). Prints one JSON line: path -> kept."""
    original = torch.nn.functional.linear
    kept = {}
    for path in config_paths:
        record_run(path)
        kept[path] = torch.nn.functional.linear is original
    print(json.dumps(kept))


# ----- deliberately broken bf16 data parallelism: the bf16 parity criterion must mark it FAIL -----
def _no_reduce(state, bucket):
    """A DDP comm hook that sends nothing: each rank keeps its own half-batch gradients."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def train_not_averaged(rank: int, world_size: int, config_path: str) -> None:
    """ddp (bf16) with its gradients never averaged over the ranks; rank 0 records its run."""
    from torch.nn.parallel import DistributedDataParallel

    from parallel_lab.strategies.ddp import DDPStrategy

    class NotAveraged(DDPStrategy):
        def setup(self, model, make_optimizer) -> None:
            self.model = DistributedDataParallel(model.to(self.device), bucket_cap_mb=self.opts.bucket_cap_mb)
            self.model.register_comm_hook(None, _no_reduce)
            self.optimizer = make_optimizer(self.model.parameters())

    record_run(config_path, NotAveraged)


def train_bf16_rows(rank: int, world_size: int, config_paths: list[str], broken_path: str | None) -> None:
    """train_and_record(config_paths), then the broken variant (unless None), in the same ranks."""
    train_and_record(rank, world_size, config_paths)
    if broken_path:
        train_not_averaged(rank, world_size, broken_path)
