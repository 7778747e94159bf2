"""Pipeline parallelism (strategy=pp): schedules, stage planning, parity with the single-process
reference for both implementations x both schedules x micro-batch counts, per-stage memory, and
bad input."""

from __future__ import annotations

import pytest

from parallel_lab.cli.run import run_ranks
from parallel_lab.errors import ConfigError
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.strategies.pp import SCHEDULES, plan_stages
from tests.conftest import assert_plan_matches
from tests.model_parallel_helpers import BATCH, DATA_SIZE, STEPS, cnn_reference


@pytest.fixture(scope="module")
def reference():
    return cnn_reference()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedule_orders_are_valid(schedule):
    """Every micro-batch goes forward once then backward once, in order; GPipe stashes all m
    activations, 1F1B at most p - s on stage s."""
    for p in range(1, 5):
        for m in range(1, 6):
            for s in range(p):
                order = SCHEDULES[schedule](m, p, s)
                assert [i for op, i in order if op == "F"] == list(range(m))
                assert [i for op, i in order if op == "B"] == list(range(m))
                inflight, peak = set(), 0
                for op, i in order:
                    if op == "F":
                        inflight.add(i)
                    else:
                        assert i in inflight, f"{schedule} p={p} m={m} s={s}: backward {i} before its forward"
                        inflight.remove(i)
                    peak = max(peak, len(inflight))
                assert peak == (m if schedule == "gpipe" else min(p - s, m)), (schedule, p, m, s, peak)


def test_stage_plan_is_contiguous_and_honours_cuts():
    model = SmallCNN()
    names = [n for n, _ in model.named_children()]
    for stages in range(1, 6):
        plan = plan_stages(model, stages, [])
        assert [n for stage in plan for n in stage] == names and len(plan) == stages
        for stage in plan:  # every stage has weights to train
            assert sum(p.numel() for n in stage for p in model.get_submodule(n).parameters()) > 0
    assert plan_stages(model, 2, ["block3"]) == [["block1", "block2"], ["block3", "flatten", "fc1", "relu", "fc2"]]
    with pytest.raises(ConfigError, match="strategy.cuts names 'relu'"):
        plan_stages(model, 2, ["relu"])
    with pytest.raises(ConfigError, match="strategy.stages=6 is more than the 5 cuttable blocks"):
        plan_stages(model, 6, [])


def _matrix(world_size: int) -> list[list[str]]:
    configs = []
    for impl in ("manual", "torch"):
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 4):
                if impl == "torch" and schedule == "1f1b" and m < world_size:
                    continue  # torch's Schedule1F1B refuses m < stages (tested as bad input below)
                configs.append([f"strategy.impl={impl}", f"strategy.schedule={schedule}", f"strategy.microbatches={m}"])
    return configs


@pytest.mark.parity
@pytest.mark.slow
def test_pp_two_stages_match_reference_in_one_set_of_ranks():
    configs = _matrix(2) + [
        # grad_accum chunks the batch, micro-batches split each chunk again: scaling must hold.
        ["strategy.impl=manual", "strategy.schedule=1f1b", "strategy.microbatches=2", "trainer.grad_accum=2"],
        ["strategy.impl=torch", "strategy.schedule=gpipe", "strategy.microbatches=2", "trainer.grad_accum=2"],
        ["strategy.impl=manual", "strategy.cuts=[fc1]", "trainer.grad_clip=0.05"],
    ]
    run_ranks(
        "tests.dist_bodies_pp:strategy_matrix_body",
        world_size=2,
        timeout=400,
        configs=configs,
        steps=STEPS,
        global_batch=BATCH,
    )


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.extra  # three stages in make test: the CLI run below (torch impl, gpipe)
def test_pp_three_stages_match_reference_in_one_set_of_ranks():
    run_ranks(
        "tests.dist_bodies_pp:strategy_matrix_body",
        world_size=3,
        timeout=400,
        configs=_matrix(3),
        steps=STEPS,
        global_batch=BATCH,
    )


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


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ["strategy.microbatches=16", "trainer.global_batch=32", "trainer.grad_accum=4"],
            ["strategy.microbatches=16", "8"],
        ),
        (["world_size=3", "strategy.stages=2"], ["strategy.stages=2", "world_size=3"]),
        (["strategy.impl=torch", "strategy.schedule=1f1b", "strategy.microbatches=1"], ["strategy.microbatches=1"]),
        (["strategy.cuts=[relu]"], ["relu"]),
        (["strategy.cuts=[fc1,block2]", "world_size=3", "strategy.stages=3"], ["strategy.cuts"]),
        (["strategy.schedule=interleaved"], ["strategy.schedule=interleaved"]),
    ],
)
def test_pp_bad_input_is_one_config_error(overrides, named):
    from tests.model_parallel_helpers import assert_one_line_config_error

    assert_one_line_config_error("pp", overrides, named)
