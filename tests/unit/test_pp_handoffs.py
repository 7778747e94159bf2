"""The pipeline replay with measured hand-off costs (pp/handoffs.py, schedules.play's ``costs``):
the play-out against a timeline worked by hand, and the costs read from a stage's marks. The
measurement on real ranks: ``bench bubbles`` (tests/integration/test_bubbles.py, extra)."""

from __future__ import annotations

import json

import pytest

from parallel_lab.strategies.pp import handoffs
from parallel_lab.strategies.pp.schedules import play, rank_orders, replay_idle_steps

# p = 2, m = 2, v = 2 (interleaved 1F1B): rank 0 holds global chunks 0 and 2, rank 1 chunks 1 and 3.
# Every forward 1 s, every backward 2 s but rank 1's B3 of micro-batch 0, measured at 3 s. Rank 0
# spends 0.25 s after each op (its isend), rank 1 0.25 s before each (posting its receives); a
# tensor reaches rank 0 0.5 s and rank 1 1 s after its producer's compute ends.
OPS0 = ["F0:0", "F0:1", "F2:0", "F2:1", "B2:0", "B2:1", "B0:0", "B0:1"]
OPS1 = ["F1:0", "F1:1", "F3:0", "B3:0", "F3:1", "B3:1", "B1:0", "B1:1"]
COSTS = [
    {"compute": {}, "pre": {}, "post": dict.fromkeys(OPS0, 0.25), "latency": 0.5},
    {"compute": {"B3:0": 3.0}, "pre": dict.fromkeys(OPS1, 0.25), "post": {}, "latency": 1.0},
]
# By hand, (op: start -> compute end; rank free again):
#   r0 F0:0 0 -> 1; 1.25     F0:1 1.25 -> 2.25; 2.5
#   r1 F1:0 ready 1 + 1 = 2, start 2 -> 3          F1:1 ready 3.25, free 3 + 0.25: 3.25 -> 4.25
#   r0 F2:0 ready 3 + 0.5: 3.5 -> 4.5; 4.75        F2:1 ready 4.75: 4.75 -> 5.75; 6
#   r1 F3:0 ready 5.5: 5.5 -> 6.5     B3:0 (own F3:0) 6.5 + 0.25: 6.75 -> 9.75 (3 s)
#   r0 B2:0 ready 10.25: 10.25 -> 12.25; 12.5
#   r1 F3:1 ready 6.75, free 10: 10 -> 11            B3:1 11.25 -> 13.25
#   r0 B2:1 ready 13.75: 13.75 -> 15.75; 16
#   r1 B1:0 ready 13.25, free 13.5: 13.5 -> 15.5     B1:1 ready 16.75: 16.75 -> 18.75
#   r0 B0:0 ready 16: 16 -> 18; 18.25                B0:1 ready 19.25: 19.25 -> 21.25; 21.5
# The step ends at 21.5; rank 0 computed 12 s, rank 1 13 s.
STEP, BUSY = 21.5, [12.0, 13.0]


def test_replay_with_handoffs_is_the_timeline_worked_by_hand():
    orders = rank_orders("interleaved_1f1b", 2, 2, 2)
    assert [f"{op}{c * 2 + r}:{i}" for r, order in enumerate(orders) for op, c, i in order] == OPS0 + OPS1
    step, busy = play(orders, [1.0] * 4, [2.0] * 4, costs=COSTS)
    assert step == pytest.approx(STEP) and busy == pytest.approx(BUSY)
    # the same through the bench's entry: one step, the chunks' compute given per op
    op_seconds = [[{"F0": 1.0, "F2": 1.0, "B0": 2.0, "B2": 2.0}], [{"F1": 1.0, "F3": 1.0, "B1": 2.0, "B3": 2.0}]]
    idle = replay_idle_steps("interleaved_1f1b", 2, 2, 2, op_seconds, [[COSTS[0]], [COSTS[1]]])
    assert idle == pytest.approx([(STEP - b) / STEP for b in BUSY])
    # rank 1 began its step 1 s late (free at 1.25 for F1:0, whose input is there at 2: the same
    # timeline); the flush ended rank 0's step 0.5 s after the last op, rank 1's 0.25 s
    late = [{**COSTS[0], "start": 0.0, "flush": 0.5}, {**COSTS[1], "start": 1.0, "flush": 0.25}]
    idle = replay_idle_steps("interleaved_1f1b", 2, 2, 2, op_seconds, [[late[0]], [late[1]]])
    assert idle == pytest.approx([(22.0 - 12.0) / 22.0, (20.75 - 13.0) / 20.75])
    # without the hand-offs the same orders idle less: what the costs add is the hand-offs'
    bare = [stage[0] for stage in handoffs.compute_only([[COSTS[0]], [COSTS[1]]])]
    assert play(orders, [1.0] * 4, [2.0] * 4, costs=bare)[0] < STEP


def marks(begin: float, compute: float, computed: float, end: float, wait: float | None = None, got=None) -> tuple:
    """One op's marks in handoffs.MARKS order (``posted`` right after ``begin``)."""
    at = {"begin": begin, "posted": begin, "wait": wait, "got": got, "compute": compute, "computed": computed}
    return tuple({**at, "end": end}[k] for k in handoffs.MARKS)


def test_costs_are_read_from_the_marks_and_latency_only_from_handoffs_waited_for():
    # stage 0: F0:0 computes 0.1 -> 1.0 (isend until 1.2), F0:1 1.2 -> 2.0 (until 2.5)
    # stage 1: waits for F0:0 from 0.3 (before it ended): got at 1.4, latency 0.4; F1:1 starts
    # waiting at 2.9, after F0:1's end at 2.0: its 0.1 wait is no measure of the crossing
    ops0 = [("F", 0, 0, *marks(0.0, 0.1, 1.0, 1.2)), ("F", 0, 1, *marks(1.2, 1.2, 2.0, 2.5))]
    stage0 = {"start": 0.0, "end": 4.5, "ops": ops0}
    stage1 = {
        "start": 0.1,
        "end": 4.6,
        "ops": [
            ("F", 1, 0, *marks(0.2, 1.5, 2.8, 2.8, wait=0.3, got=1.4)),
            ("F", 1, 1, *marks(2.8, 3.05, 4.0, 4.0, wait=2.9, got=3.0)),
        ],
    }
    c0, c1 = handoffs.step_costs([stage0, stage1])
    assert c0["compute"] == pytest.approx({"F0:0": 0.9, "F0:1": 0.8})
    assert c0["pre"] == pytest.approx({"F0:0": 0.1, "F0:1": 0.0})
    assert c0["post"] == pytest.approx({"F0:0": 0.2, "F0:1": 0.5})
    assert c0["latency"] is None  # it received nothing
    # F1:0's pre: 0.1 posting before its wait, after the step's prologue of 0.1 (its start at 0.1)
    assert c1["pre"] == pytest.approx({"F1:0": 0.2, "F1:1": 0.1}) and c1["latency"] == pytest.approx(0.4)
    assert handoffs.step_costs([stage0, stage1], one_clock=False)[1]["latency"] is None
    # stage 1 began its step 0.1 after stage 0; each step ends at its flush, 4.5 and 4.6
    assert [c[k] for c in (c0, c1) for k in ("start", "flush")] == pytest.approx([0.0, 0.5, 0.1, 0.6])
    # a step without a hand-off waited for takes the stage's mean latency of the others
    per_stage = handoffs.costs_per_step([[stage0, stage0], [stage1, {**stage1, "ops": stage1["ops"][1:]}]])
    assert [c["latency"] for c in per_stage[1]] == pytest.approx([0.4, 0.4])
    assert [c["latency"] for c in per_stage[0]] == [0.0, 0.0]
    summary = handoffs.summary(per_stage)
    assert summary["latency_s"] == pytest.approx([0.0, 0.4])
    assert summary["op_overhead_s"][0] == pytest.approx((0.3 + 0.5) / 2)


def run_marks(steps: int, skip: int) -> list[handoffs.StepRecord]:
    """Two stages' StepRecords after ``steps`` train_steps, filled as pp/manual.py fills them: each
    step 10 s after the last, stage 0's forward computing 1 + n / 1000 s in step n (which step a
    record holds can be read off it), stage 1 receiving its output."""
    records = [handoffs.StepRecord(skip) for _ in range(2)]
    for n in range(steps):
        t, f = 10.0 * n, 1.0 + n / 1000
        first = records[0].start(start=t, ops=[("F", 0, 0, *marks(t, t, t + f, t + f + 0.1))])
        second = records[1].start(start=t, ops=[])
        second["ops"].append(("F", 1, 0, *marks(t, t + f + 0.3, t + f + 1.0, t + f + 1.0, wait=t, got=t + f + 0.3)))
        first["end"] = second["end"] = t + f + 1.2  # the strategy's flush
    return records


def test_the_per_op_record_stays_bounded_however_long_the_run():
    """pp_handoff_steps and pp_op_seconds_steps (the loop's StepRecords) hold the first
    RECORDED_STEPS steps after the warm-up: a 10,000-step run writes the same record as a run of
    warm-up + RECORDED_STEPS + 3 steps, and the loop holds no more steps than that in memory."""
    skip, kept = 2, handoffs.RECORDED_STEPS
    long, short = run_marks(10_000, skip), run_marks(skip + kept + 3, skip)
    assert all(len(r.steps) == skip + kept for r in long)  # the loop's memory: bounded
    costs = handoffs.costs_per_step([r.recorded() for r in long])
    assert [len(stage) for stage in costs] == [kept, kept]
    # stage 0's forward compute: steps skip .. skip + RECORDED_STEPS - 1
    assert [c["compute"]["F0:0"] for c in costs[0]] == pytest.approx([1.0 + n / 1000 for n in range(skip, skip + kept)])
    assert json.dumps(costs) == json.dumps(handoffs.costs_per_step([r.recorded() for r in short]))
    assert [c["latency"] for c in costs[1]] == pytest.approx([0.3] * kept)  # each crossing's, the last step's too
    # a run with no step after the warm-up keeps what it has; one with a few keeps those after it
    assert [len(r.recorded()) for r in run_marks(1, skip) + run_marks(skip + 3, skip)] == [1, 1, 3, 3]
