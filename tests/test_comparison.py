"""The comparison sweep: Hydra multirun -> one report with a proven row per run, failed rows kept."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

from conftest import ROOT


def test_small_sweep_writes_a_proven_report_with_a_failed_row(tmp_path):
    # world_size=3 cannot split global_batch=20: those sweep points fail as bad config and must
    # appear as failed rows, while the rest of the report still renders.
    cmd = [sys.executable, "-m", "parallel_lab", "--multirun", "strategy=single,ddp,manual_ddp",
           "world_size=2,3", "trainer.global_batch=20", "trainer.steps=3", "trainer.progress=false",
           f"hydra.sweep.dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode != 0, "a sweep with failed runs must exit non-zero"
    for name in ("comparison.md", "comparison.csv", "comparison.json", "comparison.png"):
        assert (tmp_path / name).is_file(), name
    runs = json.loads((tmp_path / "comparison.json").read_text())
    assert len(runs) == 6  # one row per sweep point
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] == "failed"]
    assert {(r["strategy"], r["world_size"]) for r in failed} == {("ddp", 3), ("manual_ddp", 3)}
    assert all("global_batch=20" in r["error"] for r in failed)
    assert len(ok) == 4 and all(r["parity"] == "pass" for r in ok)
    with open(tmp_path / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    for row in rows:
        if row["parity"] == "pass":
            for column in ("params MiB meas/analytic", "grads MiB meas/analytic", "optim MiB meas/analytic"):
                measured, analytic = (float(v) for v in row[column].split(" / "))
                assert abs(measured - analytic) <= 0.05 * analytic, (row["strategy"], column, row[column])
        else:
            assert row["error"]
    ddp = next(r for r in ok if r["strategy"] == "ddp")
    assert abs(ddp["comm_volume_psi"] - 2.0) < 0.05  # one gradient all-reduce per step
    assert "| parity |" in result.stdout or "parity" in (tmp_path / "comparison.md").read_text()
