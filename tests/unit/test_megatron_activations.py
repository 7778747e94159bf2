"""``bench megatron_activations``: Table 2's formulas against the paper's own item list, its last
line, and one vit block's saved bytes measured in a real forward = planned on the meta device =
the paper's bytes + the differences the bench names, at t = 1 (in this process) and t = 2 (two
real gloo ranks). t = 4: ``python -m parallel_lab.bench megatron_activations`` (docs/plan.md).
The bubbles bench's format: tests/integration/test_bubbles.py and its unit test below."""

from __future__ import annotations

import re

import pytest

from parallel_lab.bench import megatron_activations as bench

A, S, H, B = 8, 64, 256, 4


def items(t: int, sp: bool, selective: bool) -> float:
    """The paper's sec. 4.1 list, bytes per layer: attention 11sbh + 5as²b, MLP 19sbh, two
    LayerNorms 4sbh; tp splits all but the LayerNorm inputs, the QKV and fc1 inputs and the two
    sublayer dropout masks (10sbh), SP those too; selective drops the 5as²b core."""
    sbh, core = S * B * H, 5 * A * S * S * B
    attention = 2 * sbh + 4 * sbh + 2 * sbh + 2 * sbh + sbh  # QKV in, Q K, V, proj in, dropout mask
    mlp = 2 * sbh + 8 * sbh + 8 * sbh + sbh  # fc1 in, GELU in, fc2 in, dropout mask
    replicated = 4 * sbh + 2 * sbh + 2 * sbh + 2 * sbh  # LN inputs, QKV in, fc1 in, two masks
    split = attention + mlp + 4 * sbh - replicated
    whole = replicated / t if sp else replicated
    return whole + split / t + (0 if selective else core / t)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_the_formulas_are_the_papers_item_list(t):
    assert bench.paper_bytes("none", 1, A, S, H, B) == items(1, False, False)
    assert bench.paper_bytes("tensor", t, A, S, H, B) == pytest.approx(items(t, False, False))
    assert bench.paper_bytes("tensor+sp", t, A, S, H, B) == pytest.approx(items(t, True, False))
    assert bench.paper_bytes("tensor+selective", t, A, S, H, B) == pytest.approx(items(t, False, True))
    assert bench.paper_bytes("tensor+sp+selective", t, A, S, H, B) == pytest.approx(items(t, True, True))
    assert bench.paper_bytes("full", t, A, S, H, B) == 2 * S * B * H


ROW_KEYS = "|".join(re.escape(row[0]) for row in bench.ROWS)
LAST = re.compile(r"^max \|measured − paper\| / paper: \d+\.\d{2}% \((" + ROW_KEYS + r"), t=\d+\)$")


def _entry(row: str, t: int, paper: float, measured: int, **extra) -> dict:
    base = {"row": row, "t": t, "paper": paper, "measured": measured, "measured_min": measured}
    return {**base, "planned": measured, "explained": measured, **extra}


def test_last_line_names_the_worst_row_and_the_checker_catches_each_kind_of_mismatch():
    entries = [_entry("tensor", 2, 100.0, 110), _entry("full", 4, 100.0, 150)]
    assert bench.last_line(entries) == "max |measured − paper| / paper: 50.00% (full, t=4)"
    assert LAST.match(bench.last_line(entries))
    assert bench.mismatches(entries) == []
    wrong = [
        _entry("tensor", 2, 100.0, 110, planned=111),
        _entry("tensor", 2, 100.0, 110, explained=109.0),
        _entry("tensor", 2, 100.0, 110, measured_min=108),
    ]
    assert [len(bench.mismatches([e])) for e in wrong] == [1, 1, 1]


@pytest.fixture(scope="module")
def measured_t1() -> list[dict]:
    return bench.table(bench.SHAPE, bench.BATCH, (1,))


def test_at_t1_planned_equals_measured_and_every_difference_is_explained(measured_t1):
    """A real bf16 forward of the block in this process vs the planner's meta count; the paper +
    the named terms (drop1's mask, LayerNorm's statistics) is the measurement to the byte."""
    assert [e["row"] for e in measured_t1] == [row for row, *_ in bench.ROWS]
    assert bench.mismatches(measured_t1) == []
    by_row = {e["row"]: e for e in measured_t1}
    assert by_row["full"]["measured"] == 2 * S * B * H  # the block's bf16 input, nothing else
    z = bench.sizes(bench.SHAPE)
    assert (z["a"], z["s"], z["h"]) == (A, S, H)
    drop1 = S * B * z["hidden"]  # one bool per element of fc1's output
    assert by_row["none"]["measured"] - by_row["none"]["paper"] > drop1 > 0
    assert LAST.match(bench.last_line(measured_t1))


@pytest.mark.slow
def test_at_t2_on_real_ranks_planned_equals_measured_and_sp_keeps_the_gathered_inputs():
    """Two gloo ranks run the split block (Megatron's manual split, with and without SP)."""
    entries = bench.table(bench.SHAPE, bench.BATCH, (2,))
    assert bench.mismatches(entries) == []
    by_row = {e["row"]: e for e in entries}
    sbh = S * B * H
    # SP keeps q/k/v's and fc1's all-gathered inputs: 2 x 2sbh x (1 - 1/2) above the paper's 34/t
    sp_terms = dict(by_row["tensor+sp"]["terms"])
    assert sum(n for text, n in sp_terms.items() if text.startswith("SP:")) == 2 * sbh
    assert by_row["tensor+sp"]["measured"] < by_row["tensor"]["measured"]  # still below tp without SP


# ----- bench bubbles: its runs and last line (the runs themselves: tests/integration/test_bubbles.py) -----
def test_bubbles_runs_every_schedule_and_its_last_line_names_the_farthest_stage():
    from parallel_lab.bench import bubbles

    runs = bubbles.configs(2, [2, 3, 4], 32)
    assert sorted(runs) == sorted([*(f"{s}|{m}" for m in (2, 4) for s in bubbles.SCHEDULES), "1f1b|3", "gpipe|3"])
    assert all(f"strategy.microbatches={k.rsplit('|')[1]}" in o for k, o in runs.items())
    rows = [
        {"schedule": "gpipe", "p": 2, "m": 4, "theory": 0.2, "idle": [0.21, 0.25], "load": [5.0, 5.1]},
        {"schedule": "1f1b", "p": 4, "m": 8, "theory": 3 / 11, "idle": [0.2, 0.3], "load": [5.0, 5.1]},
    ]
    line = bubbles.last_line(rows)
    assert line == "max |measured − formula| idle fraction: 0.073 (1f1b, p=4, m=8)"
    assert re.match(r"^max \|measured − formula\| idle fraction: \d\.\d{3} \([\w =]+, p=\d+, m=\d+\)$", line)
    assert bubbles.render(rows).count("\n") == len(rows) + 1
