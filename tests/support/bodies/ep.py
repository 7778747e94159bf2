"""Distributed test body for expert parallelism (tests/integration/test_ep.py): runs trained in
turn in one set of ranks (runs.py ``record_run``); after each zero run with ``strategy.ep``, every
rank counts what one real training forward and loss of DeepSpeed's MoE layer save for backward
with DeepSpeed's gate routing every expert an equal share (the planner's assumption), and prints
one JSON line at the end: config path -> [this rank's bytes]."""

from __future__ import annotations

import json

from tests.support.activations import balanced_deepspeed_routing, saved_for_backward_bytes
from tests.support.bodies.runs import record_run


def train_and_count_deepspeed_moe(rank: int, world_size: int, config_paths: list[str]) -> None:
    counted: dict[str, int] = {}

    def count(cfg, strategy) -> None:
        if not cfg.strategy.name.startswith("zero") or cfg.strategy.get("ep", 1) == 1:
            return
        t = cfg.trainer
        module = strategy.model.module  # the engine's: DeepSpeed's layer in place of the model's
        module.train()
        with balanced_deepspeed_routing():  # the forward exchanges tokens: collective
            counted[cfg.run_dir] = saved_for_backward_bytes(module, t.global_batch // (world_size * t.grad_accum))

    for path in config_paths:
        record_run(path, after=count)
    print(json.dumps(counted))
