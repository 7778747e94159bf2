"""strategy=tp on model=vit (Megatron's split, tp/megatron.py) on 2 real ranks, both impls, with
and without sequence parallelism and dropout: each configuration is the single run's training
(the report's parity criterion against the plain-torch reference), holds the planned model state
to the byte, issues exactly the communication of the Megatron formula (which is also the planner's
prediction), and (manual) saves the activations the planner counts. Bad input:
tests/unit/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from tests.support.bodies.tp_vit import tp_vit_body
from tests.support.matrix import assert_every_rank_passed, run_configurations

STEPS, BATCH = 3, 16
DEFAULT = {  # one set of ranks for the default suite: SP, per-rank dropout masks, both impls
    "manual-sp-dropout": ["strategy.impl=manual", "strategy.sequence_parallel=true", "model.dropout=0.1"],
    "dtensor-dropout": ["strategy.impl=dtensor", "model.dropout=0.1"],
}
EXTRA = {
    "manual": ["strategy.impl=manual"],
    "manual-sp": ["strategy.impl=manual", "strategy.sequence_parallel=true"],
    "dtensor-sp": ["strategy.impl=dtensor", "strategy.sequence_parallel=true"],
    "dtensor": ["strategy.impl=dtensor"],
    "manual-dropout": ["strategy.impl=manual", "model.dropout=0.1"],
    "manual-sp-grad_accum": ["strategy.impl=manual", "strategy.sequence_parallel=true", "trainer.grad_accum=2"],
    "dtensor-sp-grad_accum": ["strategy.impl=dtensor", "strategy.sequence_parallel=true", "trainer.grad_accum=2"],
}


@pytest.fixture(scope="module")
def default_results() -> dict[str, list]:
    return run_configurations(tp_vit_body, DEFAULT, world_size=2, timeout=300, steps=STEPS, global_batch=BATCH)


@pytest.fixture(scope="module")
def extra_results() -> dict[str, list]:
    return run_configurations(tp_vit_body, EXTRA, world_size=2, timeout=600, steps=STEPS, global_batch=BATCH)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(DEFAULT))
def test_tp_vit_is_singles_training_with_the_megatron_bytes(default_results, config):
    assert_every_rank_passed(default_results, config)


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(EXTRA))
def test_tp_vit_more_configurations(extra_results, config):
    """The rest of the matrix; test_tp_vit_is_singles_training_with_the_megatron_bytes keeps the claim in make test."""
    assert_every_rank_passed(extra_results, config)
