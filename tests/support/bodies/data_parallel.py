"""Distributed test bodies for the data-parallel strategies: several training configurations in
one set of real gloo ranks (cheaper than one CLI run each), run by
tests/integration/test_data_parallel.py and the broken variants of tests/integration/test_parity.py."""

from __future__ import annotations

import gc
import json

import torch
import torch.distributed as dist

from parallel_lab.comm import collectives
from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.config import load_run_config
from parallel_lab.models import build_model
from parallel_lab.optim import optimizer_factory
from parallel_lab.strategies import get_strategy_class
from parallel_lab.strategies.manual_ddp import ManualDDPStrategy
from parallel_lab.worker.metrics import param_checksum
from parallel_lab.worker.train import train


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
        # Every replica must hold the same weights after training (a missed sync would split them):
        # the test of this configuration asserts it.
        replicas_equal = _all_equal_across_ranks(param_checksum(strategy.state.full_parameters()))
        strategy.teardown()
        del strategy
        gc.collect()  # the clean-exit recipe (docs/facts.md): no model state alive at destroy time
        results.append(
            {
                "losses": metrics.losses,
                "final_param_checksum": metrics.final_param_checksum,
                "eval_accuracy": metrics.eval_accuracy,
                "buckets": metrics.strategy_extras["buckets"],
                "replicas_equal": replicas_equal,
            }
        )
    if rank == 0:
        print(json.dumps(results))


# ----- deliberately broken data parallelism: the parity criterion must mark these FAIL -----
class SkipsOneBucket(ManualDDPStrategy):
    """Broken on purpose: the first bucket (the last layers' gradients) is never all-reduced, so
    each rank steps those layers with its own half-batch gradient."""

    def _all_reduce(self, bucket) -> None:
        if bucket is not self.buckets[0]:
            super()._all_reduce(bucket)


class SumsInsteadOfAveraging(ManualDDPStrategy):
    """Broken on purpose: gradients summed over the ranks instead of averaged (N times too large)."""

    def _all_reduce(self, bucket) -> None:
        collectives.all_reduce(bucket.buffer, op="sum", algorithm=self.opts.allreduce)


class SameShardOnEveryRank(ManualDDPStrategy):
    """Broken on purpose: a sampler bug, every rank reads data-parallel shard 0."""

    def __init__(self, cfg, env) -> None:
        super().__init__(cfg, env)
        self.dp_rank = 0


class SkipsAllReduceAfterStep12(ManualDDPStrategy):
    """Broken on purpose: from step 12 on (the last 8 of 20) no bucket is all-reduced, so each rank
    takes its last Adam steps on its own half-batch gradient. The losses stay within the parity
    envelope (the whole-run checks cannot see 8 late steps); the replicas end different."""

    LAST_SYNCED = 12

    def __init__(self, cfg, env) -> None:
        super().__init__(cfg, env)
        self.steps_done = 0

    def _all_reduce(self, bucket) -> None:
        if self.steps_done < self.LAST_SYNCED:
            super()._all_reduce(bucket)

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self.steps_done += 1


BROKEN = {
    cls.__name__: cls
    for cls in (SkipsOneBucket, SumsInsteadOfAveraging, SameShardOnEveryRank, SkipsAllReduceAfterStep12)
}


def train_variants(rank: int, world_size: int, runs: list[list[str]]) -> None:
    """[config_path, variant] pairs: variant is a BROKEN class name or "" for the real strategy.
    Rank 0 leaves final_params.pt in each config's run folder and prints, as JSON, each run's
    losses and its replica check (the metrics.json fields of worker/replicas.py)."""
    results = []
    for config_path, variant in runs:
        cfg = load_run_config(config_path)
        env = read_dist_env(cfg.device)
        strategy = (BROKEN[variant] if variant else get_strategy_class(cfg.strategy.name))(cfg, env)
        metrics = train(cfg, env, strategy)
        replicas = {k: getattr(metrics, k) for k in ("replica_digests_agree", "replica_groups_disagree")}
        results.append([metrics.losses, replicas])
        strategy.teardown()
        del strategy
        gc.collect()
    if rank == 0:
        print(json.dumps(results))
