"""Tensor parallelism (strategy=tp): the f/g collectives, parity with the single-process
reference for both implementations, the per-rank split of the weights, and bad input."""

from __future__ import annotations

import pytest

from parallel_lab.cli.run import run_ranks
from parallel_lab.models.cnn import SmallCNN
from tests.conftest import assert_plan_matches
from tests.model_parallel_helpers import BATCH, DATA_SIZE, STEPS, cnn_reference


@pytest.fixture(scope="module")
def reference():
    return cnn_reference()


@pytest.mark.slow
def test_f_and_g_forward_and_backward_match_dense():
    """copy_to_tp (f) and reduce_from_tp (g), and the Column/RowParallel modules built on them
    (linear and conv, and a row layer fed a replicated input), against dense computation."""
    run_ranks("tests.dist_bodies_tp:autograd_collectives_body", world_size=2, timeout=180)


@pytest.mark.parity
@pytest.mark.slow
def test_tp_configurations_match_reference_in_one_set_of_ranks():
    """Both impls, the conv split, gradient accumulation: losses, every gathered parameter tensor
    and eval accuracy match the single-process reference."""
    configs = [
        ["strategy.impl=manual"],
        ["strategy.impl=dtensor"],
        ["strategy.impl=manual", "strategy.split_conv=true"],
        ["strategy.impl=manual", "trainer.grad_accum=2"],
        ["strategy.impl=dtensor", "trainer.grad_accum=2"],
        ["strategy.impl=manual", "trainer.grad_clip=0.05"],  # clipping by the norm of the FULL gradient
        ["strategy.impl=dtensor", "trainer.grad_clip=0.05"],
    ]
    run_ranks(
        "tests.dist_bodies_tp:strategy_matrix_body",
        world_size=2,
        timeout=300,
        configs=configs,
        steps=STEPS,
        global_batch=BATCH,
    )


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


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["strategy.tp=3", "world_size=3", "strategy.split_conv=true"], ["strategy.tp=3", "32", "block1.0"]),
        (["strategy.tp=4", "world_size=2"], ["strategy.tp=4", "world_size=2"]),
        (["strategy.impl=megatron"], ["strategy.impl=megatron"]),
        (["strategy.impl=dtensor", "strategy.split_conv=true"], ["strategy.split_conv=true"]),
    ],
)
def test_tp_bad_input_is_one_config_error(overrides, named):
    from tests.model_parallel_helpers import assert_one_line_config_error

    assert_one_line_config_error("tp", overrides, named)
