"""Distributed test bodies for the 2-D mesh layouts (HSDP, dp x tp, dp x pp), run with
parallel_lab.cli.run.run_ranks on 4 ranks: every layout, and deliberately broken twins that skip
the gradient average over the replicate dimension, in ONE set of processes."""

from __future__ import annotations

import gc
import json

import torch.distributed as dist

from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.report.parity import Replicas
from parallel_lab.strategies import get_strategy_class
from parallel_lab.strategies.fsdp.strategy import fsdp_units
from parallel_lab.strategies.fsdp.v2 import FSDP2
from parallel_lab.strategies.mesh import Mesh
from parallel_lab.strategies.pp.strategy import PipelineParallelStrategy
from parallel_lab.strategies.tp.strategy import TensorParallelStrategy
from parallel_lab.worker.train import train
from tests.support.model_parallel import compose_config, reference_accuracy, reference_for


# ----- broken on purpose: the parity criterion must mark these FAIL -----
class HybridWithoutReplicaAverage(FSDP2):
    """HSDP whose gradients are reduce-scattered inside each shard group but never all-reduced
    across the replicate dimension: each shard group is its own FSDP (on the 1-D shard sub-mesh)
    and steps on its own half of the batch."""

    def _wrap(self, model):
        from torch.distributed.fsdp import fully_shard

        self._mesh = Mesh(self.layout, self.device.type, self.comm).device_mesh
        for _, unit in fsdp_units(model):
            fully_shard(unit, mesh=self._mesh["shard"])
        return fully_shard(model, mesh=self._mesh["shard"])


class TPWithoutReplicaAverage(TensorParallelStrategy):
    def average_over_replicas(self) -> None:
        pass


class PPWithoutReplicaAverage(PipelineParallelStrategy):
    def average_over_replicas(self) -> None:
        pass


BROKEN = {cls.__name__: cls for cls in (HybridWithoutReplicaAverage, TPWithoutReplicaAverage, PPWithoutReplicaAverage)}


def _train_one(overrides: list[str], variant: str, steps: int, global_batch: int) -> dict:
    """Train one layout on these ranks; judge it against the plain-torch reference; return the
    verdict and what metrics.json says about the mesh (the same on every rank)."""
    cfg = compose_config(f"trainer.steps={steps}", f"trainer.global_batch={global_batch}", *overrides)
    env = read_dist_env("cpu")
    strategy = (BROKEN[variant] if variant else get_strategy_class(cfg.strategy.name))(cfg, env)
    metrics = train(cfg, env, strategy)
    ref = reference_for(steps, global_batch, cfg.trainer.grad_clip)
    label = " ".join([*overrides, variant]).strip()
    replicas = Replicas.of(metrics)  # the replica check: a twin that never averages splits its replicas
    verdict = ref.verdict(metrics.losses, strategy.state.full_parameters(), label, not variant, replicas=replicas)
    result = {
        "overrides": overrides,
        "variant": variant,
        "passed": verdict.passed,
        "reason": verdict.reason(),
        "replicas_agree": replicas.agree,
        "replica_groups": metrics.replica_groups,
        "ratios": {name: check.ratio for name, check in verdict.checks().items()},
        "mesh": metrics.strategy_extras.get("mesh"),
        "params": metrics.params,
        "ranks": [
            {
                k: r[k]
                for k in ("param_bytes", "grad_bytes", "optim_bytes", "analytic_param_bytes", "comm_bytes_by_group")
            }
            for r in metrics.ranks
        ],
        "eval_accuracy": metrics.eval_accuracy,
        "reference_accuracy": reference_accuracy(ref.net, global_batch, cfg.trainer.eval_batches),
        "losses": metrics.losses,
    }
    strategy.teardown()
    del strategy
    gc.collect()
    dist.barrier()
    return result


def layouts_body(rank: int, world_size: int, runs: list[list], steps: int, global_batch: int) -> None:
    """runs: [overrides, variant] pairs (variant: a BROKEN class name, or "" for the real strategy).
    Rank 0 prints one JSON list of results; the test makes the assertions."""
    results = [_train_one(list(overrides), variant, steps, global_batch) for overrides, variant in runs]
    if rank == 0:
        print(json.dumps(results))
