"""``python -m parallel_lab.bench zero_paper``, in-process (no workers, a meta-device model): its
paper column is the ZeRO paper's Table 1 (arXiv 1910.02054, Ψ = 7.5 B, K = 12) as published, and
its last line says how far the planner's DeepSpeed layout is from it, in a fixed format."""

from __future__ import annotations

import contextlib
import io
import re

from parallel_lab.bench import zero_paper

# Table 1 of the paper, 7.5 B model, GB per device: Nd -> (baseline, Pos, Pos+g, Pos+g+p)
PUBLISHED = {
    1: ("120", "120", "120", "120"),
    4: ("120", "52.5", "41.3", "30"),
    16: ("120", "35.6", "21.6", "7.5"),
    64: ("120", "31.4", "16.6", "1.88"),
    256: ("120", "30.4", "15.4", "0.47"),
    1024: ("120", "30.1", "15.1", "0.12"),
}
LAST_LINE = re.compile(r"max \|plan − paper\| / paper: (\d+\.\d\d)% \(stage ([0-3]), Nd (\d+)\)")


def test_zero_paper_reproduces_table_1_and_states_the_largest_difference():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert zero_paper.main([]) == 0
    text = out.getvalue()
    # The formulas, rounded as the paper rounds, are its published numbers, and the table shows them.
    for nd, row in PUBLISHED.items():
        assert tuple(zero_paper.paper_round(zero_paper.paper_bytes(s, nd) / 1e9) for s in range(4)) == row, nd
        assert f"| {nd} | " + " | ".join(row) + " |" in text
    # The last line, exactly in its format, names a real (stage, Nd) of the table: stage 2, where
    # DeepSpeed keeps whole gradients of the parameters a partition overlaps.
    last = text.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match, last
    pct, stage, nd = float(match[1]), int(match[2]), int(match[3])
    assert stage == 2 and nd in PUBLISHED and 0 < pct < 100
    # Stages 0, 1 and 3 of the plan equal the paper to within padding (< 0.01%).
    rows, _ = zero_paper.rows("resnet18", 26.0, (64,))
    for row in rows:
        if row["stage"] != 2:
            assert abs(row["plan"] - row["paper"]) / row["paper"] < 1e-4, row
