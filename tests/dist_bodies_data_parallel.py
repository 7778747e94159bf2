"""Distributed test bodies for the data-parallel strategies: several training configurations in
one set of real gloo ranks (cheaper than one CLI run each), run by tests/test_data_parallel.py."""
from __future__ import annotations

import gc
import json

import torch
import torch.distributed as dist

from parallel_lab.config import load_run_config
from parallel_lab.dist_env import read_dist_env
from parallel_lab.metrics import param_checksum
from parallel_lab.models import build_model
from parallel_lab.strategies import get_strategy_class
from parallel_lab.train import optimizer_factory, train


def _all_equal_across_ranks(value: float) -> bool:
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return len(set(values)) == 1


def check_initial_broadcast(config_path: str) -> None:
    """Replicas built from different seeds on each rank start identical to rank 0's model."""
    cfg = load_run_config(config_path)
    env = read_dist_env(cfg.device)
    strategy = get_strategy_class(cfg.strategy.name)(cfg, env)
    strategy.setup(build_model(cfg.model, seed=100 + env.rank), optimizer_factory(cfg.trainer))
    expected = build_model(cfg.model, seed=100)
    for ours, theirs in zip(strategy.model.parameters(), expected.parameters()):
        assert torch.equal(ours, theirs), "manual_ddp did not broadcast rank 0's initial weights"
    strategy.teardown()


def train_configs(rank: int, world_size: int, config_paths: list[str], broadcast_check: str | None = None) -> None:
    """Train every config in turn on these ranks; rank 0 prints one JSON list of results."""
    if broadcast_check:
        check_initial_broadcast(broadcast_check)
    results = []
    for path in config_paths:
        cfg = load_run_config(path)
        env = read_dist_env(cfg.device)
        strategy = get_strategy_class(cfg.strategy.name)(cfg, env)
        metrics = train(cfg, env, strategy)
        # Every replica must hold the same weights after training (a missed sync would split them).
        assert _all_equal_across_ranks(param_checksum(strategy.full_parameters())), f"replicas differ: {path}"
        strategy.teardown()
        del strategy
        gc.collect()  # the clean-exit recipe (FACTS.md): no model state alive at destroy time
        results.append({key: metrics[key] for key in ("losses", "final_param_checksum", "eval_accuracy", "buckets")})
    if rank == 0:
        print(json.dumps(results))
