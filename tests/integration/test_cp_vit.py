"""strategy.cp on model=vit (context parallelism, parallel_lab/strategies/cp) on 2 real ranks, each
cp_impl under ddp: each configuration is the single run's training (the report's parity criterion
against the plain-torch reference), holds the planned model state to the byte, issues exactly the
communication of the formula derived in the test body (which is also the planner's prediction),
and saves the activations the planner counts. Attention alone against full attention, and the
planted bugs: tests/unit/test_cp.py."""

from __future__ import annotations

import pytest

from tests.support.bodies.cp_vit import cp_vit_body
from tests.support.matrix import assert_every_rank_passed, run_configurations

STEPS, BATCH = 3, 16
DEFAULT = {  # one set of ranks for the default suite
    "ddp-ring": ["strategy=ddp", "strategy.cp=2", "strategy.cp_impl=ring"],
    "ddp-ulysses": ["strategy=ddp", "strategy.cp=2", "strategy.cp_impl=ulysses"],
    "ddp-deepspeed": ["strategy=ddp", "strategy.cp=2", "strategy.cp_impl=deepspeed"],
}


@pytest.fixture(scope="module")
def default_results() -> dict[str, list]:
    return run_configurations(cp_vit_body, DEFAULT, world_size=2, timeout=300, steps=STEPS, global_batch=BATCH)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(DEFAULT))
def test_cp_vit_is_singles_training_with_the_formulas_bytes(default_results, config):
    assert_every_rank_passed(default_results, config)
