"""``bench megatron_activations``: Table 2's formulas against the paper's own item list, its last
line, and one vit block's saved bytes measured in a real forward = planned on the meta device =
the paper's bytes + the differences the bench names, at t = 1 (in this process) and t = 2 (two
real gloo ranks); planned at t = 4 and 8 within 10% of the paper. Measured at t = 4:
``python -m parallel_lab.bench megatron_activations`` (docs/plan.md).
The bubbles bench's format: tests/integration/test_bubbles.py and its unit test below."""

from __future__ import annotations

import re

import pytest
import torch

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
    the named terms (LayerNorm's statistics) is the measurement to the byte."""
    assert [e["row"] for e in measured_t1] == [row for row, *_ in bench.ROWS]
    assert bench.mismatches(measured_t1) == []
    by_row = {e["row"]: e for e in measured_t1}
    assert by_row["full"]["measured"] == 2 * S * B * H  # the block's bf16 input, nothing else
    z = bench.sizes(bench.SHAPE)
    assert (z["a"], z["s"], z["h"], z["placement"]) == (A, S, H, "gpt")
    assert all(text.startswith("LayerNorm") for e in measured_t1 for text, _ in e["terms"])
    assert LAST.match(bench.last_line(measured_t1))


def test_the_vit_placement_saves_drop1s_mask_and_the_gpt_placement_none(measured_t1):
    """model.dropout_placement=vit adds a dropout after GELU: one bool per element of fc1's output
    more than gpt's layout, in a real forward; gpt's MLP has no dropout there."""
    from parallel_lab.bench.megatron_activations import _model, measured_bytes

    x = torch.randn(B, S, H, dtype=torch.bfloat16)
    saved = {
        placement: measured_bytes(
            _model({**bench.SHAPE, "dropout_placement": placement}, False).to(torch.bfloat16).block0, x, "none"
        )
        for placement in ("vit", "gpt")
    }
    hidden = bench.sizes(bench.SHAPE)["hidden"]
    assert saved["vit"] - saved["gpt"] == S * B * hidden
    assert saved["gpt"] == {e["row"]: e for e in measured_t1}["none"]["measured"]


def test_at_t4_the_plan_is_within_10_percent_of_the_paper():
    """The planner's count (= the measurement at t = 1, 2, above and in the slow test) of the split
    block on the first and last rank: paper + the named terms, each row within 10% of the paper."""
    t, z, stat = 4, bench.sizes(bench.SHAPE), bench.layer_norm_stat_bytes()
    plans = [bench.planned(bench.SHAPE, B, t, r) for r in (0, t - 1)]
    for row, *_ in bench.ROWS[1:]:
        paper = bench.paper_bytes(row, t, A, S, H, B)
        assert [p[row] for p in plans] == [paper + sum(n for _, n in bench.differences(row, t, z, B, stat))] * 2, row
        assert abs(plans[0][row] - paper) / paper < 0.10, (row, plans[0][row], paper)


@pytest.mark.slow
def test_at_t2_on_real_ranks_planned_equals_measured_and_sp_keeps_the_shard():
    """Two gloo ranks run the split block (Megatron's manual split, with and without SP). Under SP
    the column layers keep their input's shard (2sbh/t), not the gathered tokens: the paper's 34/t
    plus LayerNorm's statistics alone, to the byte."""
    entries = bench.table(bench.SHAPE, bench.BATCH, (2,))
    assert bench.mismatches(entries) == []
    by_row = {e["row"]: e for e in entries}
    for row in ("tensor+sp", "tensor+sp+selective"):
        (text, n), *more = by_row[row]["terms"]
        assert not more and text.startswith("LayerNorm") and n == 4 * B * (S // 2) * bench.layer_norm_stat_bytes()
    assert by_row["tensor+sp"]["measured"] < by_row["tensor"]["measured"]
    assert float(bench.last_line(entries).split(": ")[1].split("%")[0]) < 10


# ----- bench bubbles: its runs and last line (the runs themselves: tests/integration/test_bubbles.py) -----
def test_bubbles_runs_every_schedule_and_its_last_line_names_the_farthest_stage():
    from parallel_lab.bench import bubbles

    runs = bubbles.configs(2, [2, 3, 4], 32)
    odd = [f"{s}|3" for s in ("gpipe", "1f1b", "zero_bubble")]  # interleaved needs m a multiple of p
    assert sorted(runs) == sorted([*(f"{s}|{m}" for m in (2, 4) for s in bubbles.SCHEDULES), *odd])
    assert all(f"strategy.microbatches={k.rsplit('|')[1]}" in o for k, o in runs.items())
    rows = [
        {"schedule": "gpipe", "p": 2, "m": 4, "theory": 0.2, "replay": [0.2, 0.3], "idle": [0.21, 0.25]},
        {"schedule": "1f1b", "p": 4, "m": 8, "theory": 3 / 11, "replay": [0.22, 0.3], "idle": [0.2, 0.3]},
        {"schedule": "zero_bubble", "p": 4, "m": 8, "theory": 3 / 27, "replay": [0.1, 0.1], "idle": [0.1, 0.31]},
    ]
    handoffs = [[0.2, 0.3], [0.2, 0.29], [0.1, 0.3]]  # the replays with hand-offs, row by row
    for row, replay in zip(rows, handoffs):
        row["load"], row["replay_handoffs"], row["handoff"] = [5.0, 5.1], replay, [[0.001, 0.002], [0.003, 0.004]]
    formula, replay, with_handoffs = bubbles.last_line(rows).split("\n")
    assert formula == "max |measured − formula| idle fraction: 0.199 (zero_bubble, p=4, m=8)"
    assert replay == "max |measured − replay| idle fraction: 0.210 (zero_bubble, p=4, m=8)"
    assert with_handoffs == "max |measured − replay with hand-offs| idle fraction: 0.050 (gpipe, p=2, m=4)"
    assert "| 1.0, 3.0 / 2.0, 4.0 |" in bubbles.render(rows)  # each stage's latency, op overhead (ms)
    assert re.match(r"^max \|measured − formula\| idle fraction: \d\.\d{3} \([\w =]+, p=\d+, m=\d+\)$", formula)
    assert bubbles.render(rows).count("\n") == len(rows) + 1
    assert bubbles.zero_bubble_vs_1f1b(rows) == "zero bubble idles at most 1F1B's on every stage: no at p=4 m=8"


def test_bubbles_summary_splits_each_schedules_gap_and_ends_on_the_verdict():
    """Per schedule the stage farthest from the formula, its gap split into uneven compute,
    hand-offs and rest (they add up to it), and the last line's verdict against the 0.05 goal."""
    from parallel_lab.bench import bubbles

    rows = [  # formula 0.2: gpipe's stage 1 is 0.09 over it, 0.06 of that the hand-offs'
        {"schedule": "gpipe", "p": 2, "m": 4, "theory": 0.2, "replay": [0.2, 0.22], "replay_handoffs": [0.21, 0.28]},
        {"schedule": "gpipe", "p": 2, "m": 2, "theory": 1 / 3, "replay": [0.33, 0.34], "replay_handoffs": [0.34, 0.35]},
        {"schedule": "1f1b", "p": 2, "m": 4, "theory": 0.2, "replay": [0.2, 0.2], "replay_handoffs": [0.22, 0.21]},
    ]
    for row, idle in zip(rows, ([0.22, 0.29], [0.35, 0.36], [0.23, 0.2])):
        row["idle"] = idle
    gpipe, one = bubbles.by_schedule(rows).split("\n")
    assert gpipe.startswith("gpipe: measured 0.290 vs formula 0.200 vs replay 0.280 (p=2, m=4, stage 1): gap +0.090 ")
    assert "= uneven compute +0.020 + hand-offs +0.060 + rest +0.010; max |measured − formula| 0.090 (over" in gpipe
    assert one.endswith("max |measured − formula| 0.030 (within 0.05), max |measured − replay with hand-offs| 0.010")
    assert sum(bubbles.gap_parts(rows[0], 1)) == pytest.approx(0.29 - 0.2)
    assert bubbles.verdict(rows) == (
        "max |measured − formula| idle: 0.090 (gpipe, p=2, m=4, stage 1); "
        "max |measured − replay with hand-offs|: 0.010 (gpipe, p=2, m=4); "
        "hand-offs explain +0.060 of that gap (uneven compute +0.020, rest +0.010); "
        "formula within 0.05: not gpipe; judged (the formula where the replay of compute is within 0.02 of it, "
        "else the replay with hand-offs: 0 of 3 runs): over: gpipe m=4 by the formula 0.090"
    )
    rows[0]["idle"] = [0.22, 0.24]
    assert bubbles.verdict(rows).endswith(
        "formula within 0.05: every schedule; judged (the formula where the replay of compute is within 0.02 "
        "of it, else the replay with hand-offs: 0 of 3 runs): every run within"
    )


def test_bubbles_judges_zero_bubble_by_its_passes_and_uneven_stages_by_the_replay():
    """Zero bubble's formula at its measured F, B, W (``passes``) is what it is judged by, the gap to
    the equal-pass formula split with an 'unequal passes' part; a run whose replay of compute is
    off its formula by more than 0.02 (its compute was not the formula's) is judged by its replay."""
    from parallel_lab.bench import bubbles

    zb = {"schedule": "zero_bubble", "p": 2, "m": 8, "theory": 0.04, "passes": 0.074}
    zb |= {"replay": [0.08, 0.07], "replay_handoffs": [0.09, 0.08], "idle": [0.10, 0.09]}
    uneven = {"schedule": "gpipe", "p": 2, "m": 8, "theory": 0.111, "replay": [0.13, 0.2]}
    uneven |= {"replay_handoffs": [0.14, 0.21], "idle": [0.15, 0.215]}
    assert bubbles.judged(zb) == ("formula", pytest.approx(0.026))
    assert bubbles.judged(uneven) == ("replay", pytest.approx(0.01))
    assert bubbles.gap_parts(zb, 0) == pytest.approx((0.034, 0.006, 0.01, 0.01))
    line = bubbles.by_schedule([zb])
    assert "vs formula 0.074 (equal passes 0.040) vs replay 0.090" in line
    assert "gap +0.060 = unequal passes +0.034 + uneven compute +0.006 + hand-offs +0.010 + rest +0.010" in line
    assert bubbles.verdict([zb, uneven]).endswith("1 of 2 runs): every run within")
    uneven["idle"] = [0.15, 0.30]  # 0.09 off its replay: a loop that waits
    assert bubbles.verdict([zb, uneven]).endswith("1 of 2 runs): over: gpipe m=8 by the replay 0.090")


def test_zero_bubble_formula_at_its_passes_is_qi_et_als_and_equal_passes_the_textbooks():
    """schedules.zero_bubble_fraction plays ZB-H1's order out: at F = B = W it is (p-1)/(3m+p-1), and
    for W <= F <= B the paper's (p-1)(F+B-W) over m(F+B+W) (computed here), above the equal-pass one."""
    from parallel_lab.strategies.pp.schedules import bubble_fraction, zero_bubble_fraction

    for p, m in ((2, 2), (2, 8), (4, 4), (4, 8)):
        assert zero_bubble_fraction(m, p, 1, 1, 1) == pytest.approx(bubble_fraction("zero_bubble", m, p))
        for f, b, w in ((18, 25, 8), (1, 3, 0.5), (2, 2, 1)):
            bubble = (p - 1) * (f + b - w)
            assert zero_bubble_fraction(m, p, f, b, w) == pytest.approx(bubble / (bubble + m * (f + b + w)))
            assert zero_bubble_fraction(m, p, f, b, w) > bubble_fraction("zero_bubble", m, p)
