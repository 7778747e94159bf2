"""``bench bubbles`` on real ranks (extra: timing on a shared 2-core machine, 1-3 minutes):
every schedule of the pipeline strategy runs at p = 2, m = 2 and 8, cut by measured time, reports
each stage's idle share and the formula, computed here independently. The formulas are kept alive
in the default suite by tests/unit/test_pipeline_parallel.py test_orders_played_out_idle_the_formula
(the orders played out); the bench's format and verdict by tests/unit/test_megatron_activations.py."""

from __future__ import annotations

import os
import statistics

import pytest

BALANCED = 0.02  # the formula's assumptions held: every stage's replay of compute within this of it
FORMULA_GOAL = 0.05  # issue 47: measured idle within 0.05 of the formula
ORDER_SLACK = 0.01  # measured - replay with hand-offs was 0.000-0.003 for zero bubble and 1F1B, load 8-16
REPLAY_GOAL = 0.03  # measured vs the replay with hand-offs: 0.007 seen quiet, 0.015 at load 5-13


def formula_here(row: dict) -> float:
    """The run's formula, computed here: (p-1)/(m+p-1) gpipe and 1f1b, (p-1)/(vm+p-1) interleaved,
    and zero bubble's at its measured mean passes, Qi et al.'s (p-1)(F+B-W) over m(F+B+W)
    (arXiv 2401.10241), which holds for W <= F <= B, this vit's regime; a loaded run's F can pass
    its B, and then the bench's played-out order is taken (schedules.zero_bubble_fraction, checked
    against the closed form in tests/unit/test_megatron_activations.py)."""
    p, m = row["p"], row["m"]
    if row["schedule"] != "zero_bubble":
        v = 2 if row["schedule"].startswith("interleaved") else 1
        return (p - 1) / (v * m + p - 1)
    f, b, w = (row["pass_s"][op] for op in "FBW")
    if not w <= f <= b:
        return row["passes"]
    bubble = (p - 1) * (f + b - w)
    return bubble / (bubble + m * (f + b + w))


@pytest.mark.extra
@pytest.mark.slow
def test_every_run_idles_its_formula_or_its_replay_and_zero_bubble_at_most_1f1bs():
    """p = 2, m = 2 and 8, every schedule, cut by balance=time (blocks timed in the parent as their
    stage runs them): each stage's idle share is in (0, 1); where the run's compute is what the
    formula assumes (every stage's replay of compute within BALANCED of the formula computed
    here), every stage's measured idle is within FORMULA_GOAL of it; elsewhere (the stages
    computed unequally in the run, or ops ran faster beside an idle neighbour: a cut made
    beforehand cannot control either) within REPLAY_GOAL of the replay with measured hand-offs,
    which plays the schedule's orders (schedules.rank_orders; zero bubble's built from the
    parent's per-stage passes, pp/zb_orders.py, as every rank builds it), not the loop's. Zero bubble idles
    at most 1F1B's on every stage at each m, or above it by no more than its replay with hand-offs
    is above 1F1B's, + ORDER_SLACK (the ranks' compute differs from run to run, pass by pass and in
    total: with ZB-H1's order, strictly per stage failed two of four runs at m = 8, 0.145 against
    0.139 and 0.241 against 0.078, both explained by their replays; the built order, one of three
    at m = 2, stage 1 0.362 against 0.283, its ranks computing 0.83 and 0.61 s on a cut timed equal,
    replayed 0.359 against 0.282); and its order, replayed at its own run's measured compute, idles
    at most 1F1B's order at that compute + ORDER_SLACK (each B and its W one backward): a bad
    order fails there whatever the other runs computed. GPipe's and 1F1B's idle falls from m = 2 to 8.
    Planted (the manual loop running each W right after its B, the schedule's order left as it
    is): zero bubble m = 2 idled 0.176 / 0.178 against its replay's 0.140 / 0.133 and the test
    failed on the replay (still below 1F1B's 0.258 / 0.271: that check alone would not catch it).
    Runs: benchmarks/results/bubbles_cpu.md."""
    from parallel_lab.bench import bubbles

    p = 2
    rows = bubbles.measure(p, [2, 8], 32, 5)
    print(bubbles.render(rows), "\nload average", os.getloadavg())
    print(bubbles.verdict(rows))
    print([(r["m"], r["replay"], r["replay_1f1b_order"]) for r in rows if r["schedule"] == "zero_bubble"])
    assert sorted((r["schedule"], r["m"]) for r in rows) == sorted((s, m) for s in bubbles.SCHEDULES for m in (2, 8))
    for r in rows:
        equal = {"interleaved_1f1b v=2": 2, "zero_bubble": 3}.get(r["schedule"], 1)  # ZB-H1 at F = B = W
        assert r["theory"] == pytest.approx((p - 1) / (equal * r["m"] + p - 1)), r
        for key in ("replay", "replay_handoffs", "idle"):
            assert len(r[key]) == p and all(0 < f < 1 for f in r[key]), (key, r)
        formula = formula_here(r)
        assert r["passes"] == pytest.approx(formula), r
        if all(abs(f - formula) <= BALANCED for f in r["replay"]):
            assert all(abs(f - formula) <= FORMULA_GOAL for f in r["idle"]), ("formula", formula, r)
        else:
            assert all(abs(f - x) <= REPLAY_GOAL for f, x in zip(r["idle"], r["replay_handoffs"])), ("replay", r)
    idle = {(r["schedule"], r["m"]): r["idle"] for r in rows}
    replay = {(r["schedule"], r["m"]): r["replay_handoffs"] for r in rows}
    for m in (2, 8):  # above 1F1B only by what the replays of the runs' own costs put it above
        allowed = [max(0.0, z - o) + ORDER_SLACK for z, o in zip(replay["zero_bubble", m], replay["1f1b", m])]
        assert all(z <= o + a for z, o, a in zip(idle["zero_bubble", m], idle["1f1b", m], allowed)), (m, idle, replay)
        # the order itself: at zero bubble's own measured compute, at most 1F1B's order's idle
        zb = next(r for r in rows if r["schedule"] == "zero_bubble" and r["m"] == m)
        assert all(z <= o + ORDER_SLACK for z, o in zip(zb["replay"], zb["replay_1f1b_order"])), zb
    for schedule in ("gpipe", "1f1b"):
        assert statistics.mean(idle[schedule, 8]) < statistics.mean(idle[schedule, 2]), (schedule, idle)
