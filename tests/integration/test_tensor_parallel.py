"""Tensor parallelism (strategy=tp) on real ranks: the f/g collectives, parity with the
single-process reference for both implementations, and the per-rank split of the weights. Bad
input (refused in the parent, in-process): tests/unit/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from parallel_lab.cli.run import run_ranks
from parallel_lab.models.cnn import SmallCNN
from tests.support.bodies.tp import autograd_collectives_body, strategy_matrix_body
from tests.support.checks import assert_plan_matches
from tests.support.matrix import assert_every_rank_passed, run_configurations
from tests.support.model_parallel import BATCH, DATA_SIZE, STEPS, cnn_reference


@pytest.fixture(scope="module")
def reference():
    return cnn_reference()


@pytest.mark.floats  # tolerances against dense layers
@pytest.mark.slow
def test_f_and_g_forward_and_backward_match_dense():
    """copy_to_tp (f) and reduce_from_tp (g), and the Column/RowParallel modules built on them
    (linear and conv, and a row layer fed a replicated input), against dense computation."""
    run_ranks(autograd_collectives_body, world_size=2, timeout=180)


TP_CONFIGS = {  # id -> overrides; both impls, the conv split, gradient accumulation, clipping
    "manual": ["strategy.impl=manual"],
    "dtensor": ["strategy.impl=dtensor"],
    "manual-split_conv": ["strategy.impl=manual", "strategy.split_conv=true"],
    "manual-grad_accum": ["strategy.impl=manual", "trainer.grad_accum=2"],
    "dtensor-grad_accum": ["strategy.impl=dtensor", "trainer.grad_accum=2"],
    "manual-grad_clip": ["strategy.impl=manual", "trainer.grad_clip=0.05"],  # clipping by the norm of the FULL gradient
    "dtensor-grad_clip": ["strategy.impl=dtensor", "trainer.grad_clip=0.05"],
}


@pytest.fixture(scope="module")
def tp_configurations() -> dict[str, list]:
    """Every TP_CONFIGS configuration trained in one set of 2 ranks; id -> each rank's failure or None."""
    return run_configurations(
        strategy_matrix_body, TP_CONFIGS, world_size=2, timeout=300, steps=STEPS, global_batch=BATCH
    )


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(TP_CONFIGS))
def test_tp_configurations_match_reference_in_one_set_of_ranks(tp_configurations, config):
    """Losses, every gathered parameter tensor and eval accuracy match the single-process
    reference, and each rank holds less than the whole model."""
    assert_every_rank_passed(tp_configurations, config)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["manual", pytest.param("dtensor", marks=pytest.mark.extra)])  # dtensor: matrix above
def test_tp_cli_matches_reference_and_splits_the_head(cli, reference, impl):
    m = cli(
        "strategy=tp",
        f"strategy.impl={impl}",
        "world_size=2",
        f"trainer.steps={STEPS}",
        f"trainer.global_batch={BATCH}",
        f"data.size={DATA_SIZE}",
    )
    reference.assert_run_matches(m)
    # Each rank holds half of fc1 (weight rows + bias) and half of fc2's weight columns, the rest whole.
    dense = SmallCNN()
    total = sum(p.numel() for p in dense.parameters())
    split = dense.fc1.weight.numel() + dense.fc1.bias.numel() + dense.fc2.weight.numel()
    expected = 4 * (total - split + split // 2)
    assert [r["param_bytes"] for r in m["ranks"]] == [expected, expected]
    assert [r["analytic_param_bytes"] for r in m["ranks"]] == [expected, expected]
    assert m["strategy_extras"]["tp_split_layers"] == {"fc1": "column", "fc2": "row"}
    assert_plan_matches(m)
