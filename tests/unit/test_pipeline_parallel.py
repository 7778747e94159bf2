"""Pipeline parallelism (strategy=pp), in-process: the schedules' orders, stage planning, and bad
input as one config error. The strategy on real ranks: tests/integration/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest

from parallel_lab.errors import ConfigError
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.strategies.pp import SCHEDULES, plan_stages
from tests.support.model_parallel import assert_one_line_config_error


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
    assert_one_line_config_error("pp", overrides, named)
