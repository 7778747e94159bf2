"""Pipeline parallelism (strategy=pp), in-process: the schedules' orders, stage planning, and bad
input as one config error. The strategy on real ranks: tests/integration/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest

from parallel_lab.errors import ConfigError
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.strategies.pp import SCHEDULES, plan_stages
from parallel_lab.strategies.pp.schedules import gpipe_first_stage_idle, gpipe_step_time
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


def _simulated_gpipe(forward: list[float], backward: list[float], m: int) -> tuple[float, float]:
    """(step time, first stage's idle) of a GPipe step, event by event: a micro-batch enters a
    stage when it left the previous one and the stage finished the previous micro-batch; backward
    starts on the last stage once its forwards are done, and runs back."""
    p, done = len(forward), [0.0] * len(forward)
    for _ in range(m):
        for s in range(p):
            done[s] = max(done[s], done[s - 1] if s else 0.0) + forward[s]
    back = [done[-1]] * p
    for _ in range(m):
        for s in reversed(range(p)):
            back[s] = max(back[s], back[s + 1] if s + 1 < p else 0.0) + backward[s]
    return back[0], back[0] - m * (forward[0] + backward[0])


def test_gpipe_prediction_is_the_bubble_for_equal_stages_and_the_schedule_otherwise():
    """Equal stages: the first stage idles (p-1)/(m+p-1) of the step (arXiv 1811.06965). Unequal
    ones (what a real cut gives, backward not always the same multiple of forward): the same
    prediction as playing the schedule out."""
    for p in range(1, 5):
        for m in range(1, 7):
            fwd, bwd = [1.0 * m] * p, [2.0 * m] * p
            share = gpipe_first_stage_idle(fwd, bwd, m) / gpipe_step_time(fwd, bwd, m)
            assert share == pytest.approx((p - 1) / (m + p - 1))
    cases = (([1.0, 0.5], [2.0, 1.0]), ([0.4, 1.0], [1.5, 1.0]), ([1.0, 0.3, 0.7], [0.5, 0.9, 1.4]))
    for forward, backward in (*cases, ([0.2, 0.9, 0.9, 0.1], [0.4, 0.3, 2.0, 0.2])):
        for m in (1, 2, 4, 8):
            fwd, bwd = [m * f for f in forward], [m * b for b in backward]
            step, idle = _simulated_gpipe(forward, backward, m)
            assert gpipe_step_time(fwd, bwd, m) == pytest.approx(step), (forward, backward, m)
            assert gpipe_first_stage_idle(fwd, bwd, m) == pytest.approx(idle), (forward, backward, m)
