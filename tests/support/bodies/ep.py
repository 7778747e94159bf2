"""Distributed test body for expert parallelism (tests/integration/test_ep.py): runs trained in
turn in one set of ranks (runs.py ``record_run``); after each run with ``strategy.ep`` under zero
(DeepSpeed's MoE layer) or tp, every rank counts what one real training forward and loss save for
backward with the router dealing every expert an equal share (the planner's assumption: under ep
what a rank's experts save depends on the copies they receive), and prints one JSON line at the
end: run folder -> this rank's bytes."""

from __future__ import annotations

import json

from tests.support.activations import balanced_deepspeed_routing, balanced_routing, saved_for_backward_bytes
from tests.support.bodies.runs import record_run


def train_and_count_ep_activations(rank: int, world_size: int, config_paths: list[str]) -> None:
    counted: dict[str, int] = {}

    def count(cfg, strategy) -> None:
        zero = cfg.strategy.name.startswith("zero")
        if cfg.strategy.get("ep", 1) == 1 or not (zero or cfg.strategy.name == "tp"):
            return
        micro = cfg.trainer.global_batch // (type(strategy).plan.data_parallel_size(cfg) * cfg.trainer.grad_accum)
        module = strategy.model.module if zero else strategy.model  # the engine's: DeepSpeed's layer in place
        module.train()
        with balanced_deepspeed_routing() if zero else balanced_routing():  # the forward exchanges: collective
            counted[cfg.run_dir] = saved_for_backward_bytes(module, micro)

    for path in config_paths:
        record_run(path, after=count)
    print(json.dumps(counted))
