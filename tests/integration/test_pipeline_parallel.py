"""Pipeline parallelism (strategy=pp) on real ranks: parity with the single-process reference for
both implementations x both schedules x micro-batch counts, and per-stage memory. Schedules, stage
planning and bad input, in-process: tests/unit/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest

from parallel_lab.models.cnn import SmallCNN
from tests.support.bodies.pp import strategy_matrix_body
from tests.support.checks import assert_plan_matches
from tests.support.matrix import assert_every_rank_passed, run_configurations
from tests.support.model_parallel import BATCH, DATA_SIZE, STEPS, cnn_reference


@pytest.fixture(scope="module")
def reference():
    return cnn_reference()


def _matrix(world_size: int) -> dict[str, list[str]]:
    """id -> overrides: both impls x both schedules x 1, 2, 4 micro-batches."""
    configs = {}
    for impl in ("manual", "torch"):
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 4):
                if impl == "torch" and schedule == "1f1b" and m < world_size:
                    continue  # torch's Schedule1F1B refuses m < stages (bad input, tests/unit)
                overrides = [f"strategy.impl={impl}", f"strategy.schedule={schedule}", f"strategy.microbatches={m}"]
                configs[f"{impl}-{schedule}-m{m}"] = overrides
    return configs


TWO_STAGES = _matrix(2) | {
    # grad_accum chunks the batch, micro-batches split each chunk again: scaling must hold.
    "manual-1f1b-m2-grad_accum": [
        "strategy.impl=manual",
        "strategy.schedule=1f1b",
        "strategy.microbatches=2",
        "trainer.grad_accum=2",
    ],
    "torch-gpipe-m2-grad_accum": [
        "strategy.impl=torch",
        "strategy.schedule=gpipe",
        "strategy.microbatches=2",
        "trainer.grad_accum=2",
    ],
    "manual-cut_fc1-grad_clip": ["strategy.impl=manual", "strategy.cuts=[fc1]", "trainer.grad_clip=0.05"],
    # 4 chunks of the cnn's 5 blocks, 2 per rank (non-contiguous: the gather reorders them)
    "manual-interleaved-v2-m4": ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"],
    "torch-interleaved-v2-m2": [
        "strategy.impl=torch",
        "strategy.schedule=interleaved_1f1b",
        "strategy.virtual_stages=2",
        "strategy.microbatches=2",
    ],
    "torch-zero_bubble-v2-m4": ["strategy.impl=torch", "strategy.schedule=zero_bubble", "strategy.virtual_stages=2"],
    "manual-balance_params": ["strategy.balance=params"],
}
THREE_STAGES = _matrix(3)


@pytest.fixture(scope="module")
def two_stages() -> dict[str, list]:
    """Every TWO_STAGES configuration trained in one set of 2 ranks; id -> each rank's failure or None."""
    return run_configurations(
        strategy_matrix_body, TWO_STAGES, world_size=2, timeout=400, steps=STEPS, global_batch=BATCH
    )


@pytest.fixture(scope="module")
def three_stages() -> dict[str, list]:
    """Every THREE_STAGES configuration trained in one set of 3 ranks; id -> each rank's failure or None."""
    return run_configurations(
        strategy_matrix_body, THREE_STAGES, world_size=3, timeout=400, steps=STEPS, global_batch=BATCH
    )


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(TWO_STAGES))
def test_pp_two_stages_match_reference_in_one_set_of_ranks(two_stages, config):
    assert_every_rank_passed(two_stages, config)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.extra  # three stages in make test: the CLI run below (torch impl, gpipe)
@pytest.mark.parametrize("config", list(THREE_STAGES))
def test_pp_three_stages_match_reference_in_one_set_of_ranks(three_stages, config):
    assert_every_rank_passed(three_stages, config)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("world_size, impl, schedule", [(2, "manual", "1f1b"), (3, "torch", "gpipe")])
def test_pp_cli_matches_reference_and_splits_by_stage(cli, reference, world_size, impl, schedule):
    m = cli(
        "strategy=pp",
        f"world_size={world_size}",
        f"strategy.stages={world_size}",
        f"strategy.impl={impl}",
        f"strategy.schedule={schedule}",
        "strategy.microbatches=4",
        f"trainer.steps={STEPS}",
        f"trainer.global_batch={BATCH}",
        f"data.size={DATA_SIZE}",
    )
    reference.assert_run_matches(m)
    # Each rank holds exactly the parameters of the layers of its stage, and together all of them.
    dense = SmallCNN()
    stage_bytes = [
        4 * sum(p.numel() for n in names for p in dense.get_submodule(n).parameters())
        for names in m["strategy_extras"]["pp_stage_layers"]
    ]
    assert [r["param_bytes"] for r in m["ranks"]] == stage_bytes
    assert sum(stage_bytes) == 4 * sum(p.numel() for p in dense.parameters()) and len(stage_bytes) == world_size
    extras = m["strategy_extras"]
    assert len(extras["pp_idle_s"]) == world_size and 0 < extras["pp_bubble_fraction_theory"] < 1
    assert_plan_matches(m)
