"""Test body for tests/integration/test_plugins.py: a plugin strategy in compare_all's resolved
sweep and in the report of its finished run, each through the command's own main(), in one rank
forked from the zygote with the plugin's folder on sys.path and PARALLEL_LAB_PLUGINS in the rank's
environment. The plugin's own run stays a real ``python -m parallel_lab`` (PYTHONPATH, parent,
zygote and rank); the sweep listing and the report were two more fresh interpreters, each paying
torch's import for the plugin's class (about 11 s of CPU together)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from parallel_lab.cli.run import run_cli
from parallel_lab.report.__main__ import main as report_main


def sweep_and_report(rank: int, world_size: int, folder: str, run_dir: str) -> None:
    """Prints one JSON line: the resolved sweep config's stdout and the report's stdout."""
    sys.path.insert(0, folder)  # what PYTHONPATH does for a fresh interpreter (plugins.py)
    shown = run_cli(Path(folder) / "shown", "+experiment=compare_all", "--cfg", "all", "--resolve", in_process=True)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = report_main([run_dir])
    assert code == 0, f"the report exited {code}"
    print(json.dumps({"sweep": shown.stdout, "report": report.getvalue()}))
