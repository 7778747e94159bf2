"""``bench bubbles`` on real ranks (extra: timing on a shared 2-core machine, about a minute):
every schedule of the pipeline strategy runs at p = 2, m = 4, reports each stage's idle share and
the formula, computed here independently. The formulas are kept alive in the default suite by
tests/unit/test_pipeline_parallel.py test_orders_played_out_idle_the_formula (the orders played
out); the bench's format by tests/unit/test_megatron_activations.py
test_bubbles_runs_every_schedule_and_its_last_line_names_the_farthest_stage."""

from __future__ import annotations

import os

import pytest


@pytest.mark.extra
@pytest.mark.slow
def test_every_schedule_reports_idle_per_stage_beside_its_formula():
    from parallel_lab.bench import bubbles

    p, m = 2, 4
    rows = {r["schedule"]: r for r in bubbles.measure(p, [m], 32, 5)}
    assert sorted(rows) == sorted(bubbles.SCHEDULES)
    formula = {
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "interleaved_1f1b v=2": (p - 1) / (2 * m + p - 1),
        "zero_bubble v=2 impl=torch": (p - 1) / (2 * m + p - 1),  # the strategy's upper bound
    }
    print(bubbles.render(list(rows.values())), "\nload average", os.getloadavg())
    for name, row in rows.items():
        assert row["theory"] == pytest.approx(formula[name]), name
        assert len(row["idle"]) == p and all(0 < f < 1 for f in row["idle"]), (name, row["idle"])
    # GPipe's bubble is the longest and least sensitive to hand-off noise (docs/pp.md): within 0.1
    assert all(abs(f - formula["gpipe"]) < 0.1 for f in rows["gpipe"]["idle"]), rows["gpipe"]
