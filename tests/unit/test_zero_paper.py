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


def _run(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert zero_paper.main(list(argv)) == 0
    return out.getvalue()


def _last(text: str) -> tuple[float, int, int]:
    last = text.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match, last
    return float(match[1]), int(match[2]), int(match[3])


def test_zero_paper_reproduces_table_1_on_a_transformer_within_5_percent():
    text = _run()
    # The formulas, rounded as the paper rounds, are its published numbers, and the table shows them.
    for nd, row in PUBLISHED.items():
        assert tuple(zero_paper.paper_round(zero_paper.paper_bytes(s, nd) / 1e9) for s in range(4)) == row, nd
        assert f"| {nd} | " + " | ".join(row) + " |" in text
    # The shape a reader compares with the paper's is printed, and it is ~7.5 B parameters.
    assert "hidden 4096, 37 layers, 32 heads of 128" in text
    # Its Ψ is the paper's parameter count, which the header says (glossary.md#psi: bytes everywhere else).
    assert "Ψ here is the paper's: a parameter count" in text.splitlines()[0]
    _, params, _ = zero_paper.scaled_model("vit", zero_paper.parse_shape("vit", None, None))
    assert abs(params - 7.5e9) / 7.5e9 < 0.01
    # The last line, exactly in its format: the transformer's plan is within 5% of the paper everywhere,
    # and the largest difference is stage 2's (DeepSpeed keeps whole gradients of overlapped parameters).
    pct, stage, nd = _last(text)
    assert stage == 2 and nd in PUBLISHED and 0 < pct < 5, (pct, stage, nd)


def test_the_cnn_table_stays_an_option_with_its_explanation():
    """resnet18 at width 26: one tensor is 21% of Ψ, so stage 2 is far from the paper, and says why."""
    text = _run("--model", "resnet18", "--nd", "64,1024")
    assert "resnet18 width 26 (7,542,900,362 parameters)" in text
    assert "21% of the resnet18's Ψ" in text
    pct, stage, nd = _last(text)
    assert stage == 2 and nd == 1024 and pct > 5
    # Stages 0, 1 and 3 of the plan equal the paper to within padding (< 0.01%).
    rows, _ = zero_paper.rows("resnet18", zero_paper.parse_shape("resnet18", None, None), (64,))
    for row in rows:
        if row["stage"] != 2:
            assert abs(row["plan"] - row["paper"]) / row["paper"] < 1e-4, row
