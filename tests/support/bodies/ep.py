"""Distributed test body for expert parallelism (tests/integration/test_ep.py): runs trained in
turn in one set of ranks (runs.py ``record_run``); after each run with ``strategy.ep`` under zero
(DeepSpeed's MoE layer), tp or fsdp, every rank counts what one real training forward and loss
save for backward with the router dealing every expert an equal share (the planner's assumption:
under ep what a rank's experts save depends on the copies they receive), and prints one JSON line
at the end: run folder -> this rank's bytes."""

from __future__ import annotations

import json

import torch

from tests.support.activations import (
    balanced_deepspeed_routing,
    balanced_routing,
    saved_beside_sharded_parameters,
    saved_for_backward_bytes,
)
from tests.support.bodies.runs import record_run


def saved_by_a_sharded_forward(strategy, batch: int) -> int:
    """What one training forward and loss of an FSDP2 model save for backward, without its
    parameters (tests/support/activations.py; the experts, outside fully_shard, are plain
    parameters throughout)."""
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    return saved_beside_sharded_parameters(
        strategy.model, lambda: strategy.forward_loss(x, torch.zeros(batch, dtype=torch.long))
    )


def train_and_count_ep_activations(rank: int, world_size: int, config_paths: list[str]) -> None:
    counted: dict[str, int] = {}

    def count(cfg, strategy) -> None:
        name = cfg.strategy.name
        zero = name.startswith("zero")
        if cfg.strategy.get("ep", 1) == 1 or not (zero or name == "tp" or name == "fsdp" and cfg.model.name == "vit"):
            return  # (the MoE gpt under fsdp: its activations are not claimed here)
        micro = cfg.trainer.global_batch // (type(strategy).plan.data_parallel_size(cfg) * cfg.trainer.grad_accum)
        module = strategy.model.module if zero else strategy.model  # the engine's: DeepSpeed's layer in place
        module.train()
        with balanced_deepspeed_routing() if zero else balanced_routing():  # the forward exchanges: collective
            if name == "fsdp":  # the gathered weights are parameters while registered
                counted[cfg.run_dir] = saved_by_a_sharded_forward(strategy, micro)
            else:
                counted[cfg.run_dir] = saved_for_backward_bytes(module, micro)

    for path in config_paths:
        record_run(path, after=count)
    print(json.dumps(counted))
