"""The comparison sweep: Hydra multirun -> one report with a proven row per run, failed rows kept."""

from __future__ import annotations

import csv
import json

from parallel_lab.report.parity import ENVELOPE_MULTIPLE, noise_reruns
from tests.support.cli import run_cli


# Not marker floats: the report's verdicts are judge_runs on single and ddp runs, which the parity tests
# judge again under the foreign dispatch; the sweep and rendering move no float (docs/testing.md).
def test_small_sweep_writes_a_proven_report_with_a_failed_row(tmp_path):
    # world_size=3 cannot split global_batch=20: those sweep points fail as bad config and must
    # appear as failed rows, while the rest of the report still renders.
    result = run_cli(
        tmp_path / "unused",
        "--multirun",
        "strategy=single,ddp",
        "world_size=2,3",
        "trainer.global_batch=20",
        "trainer.steps=3",
        f"hydra.sweep.dir={tmp_path}",
        check=False,
        timeout=900,
    )
    assert result.returncode != 0, "a sweep with failed runs must exit non-zero"
    for name in ("comparison.md", "comparison.csv", "comparison.json", "comparison.png", "comparison_parity.png"):
        assert (tmp_path / name).is_file(), name
    runs = json.loads((tmp_path / "comparison.json").read_text())
    # One row per sweep point, plus the baseline's noise-floor reruns (single runs 2 threads at world 2).
    noise = [r for r in runs if r.get("noise_rerun") is not None]
    assert sorted(r["noise_rerun"] for r in noise) == sorted(noise_reruns(20, 1, 2))
    assert all(r["strategy"] == "single" and r["parity"] == "envelope" for r in noise)
    runs = [r for r in runs if r not in noise]
    assert len(runs) == 4
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] == "failed"]
    assert {(r["strategy"], r["world_size"]) for r in failed} == {("ddp", 3)}
    assert all("global_batch=20" in r["error"] for r in failed)
    assert len(ok) == 3 and all(r["parity"] == "pass" for r in ok)
    for run in ok:  # each verdict carries its evidence: divergence, envelope, floor, ratio per check
        assert set(run["parity_checks"]) >= {"early_dloss", "max_dloss", "param_rel_l2", "param_max_abs"}
        assert all(c["ratio"] <= ENVELOPE_MULTIPLE for k, c in run["parity_checks"].items() if isinstance(c, dict))
    with open(tmp_path / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 + len(noise)
    for row in rows:
        if row["parity"] in ("pass", "envelope"):
            for kind in ("params", "grads", "optim"):
                measured, analytic = float(row[f"{kind} MiB measured"]), float(row[f"{kind} MiB analytic"])
                assert abs(measured - analytic) <= 0.05 * analytic, (row["strategy"], kind, measured, analytic)
        else:
            assert row["error"]
    ddp = next(r for r in ok if r["strategy"] == "ddp")
    assert abs(ddp["comm_volume_psi"] - 2.0) < 0.05  # one gradient all-reduce per step
    table = [line for line in (tmp_path / "comparison.md").read_text().splitlines() if line.startswith("| ")]
    assert sum(" pass |" in line for line in table) == len(ok)  # the md table shows each verdict
    assert sum(" envelope |" in line for line in table) == len(noise)
