"""The whole comparison of some runs: the tables (``table.py``, from the rows of ``rows.py`` and the
columns of ``columns.py``) and their plots (``plots.py``)."""

from __future__ import annotations

from pathlib import Path

from parallel_lab.report.plots import plot_comparison, plot_parity, plot_timeline
from parallel_lab.report.rows import Row
from parallel_lab.report.table import write_tables


def write_report(runs: list[Row], out: Path, peaks: list[dict] | None = None) -> str:
    """comparison.md/.csv/.json, comparison.png/comparison_parity.png and, where runs were profiled,
    timeline.png in out; returns the md. peaks: the machine's measured peaks (MFU), None: none."""
    text = write_tables(runs, out, peaks)
    plot_comparison(runs, out)
    plot_parity(runs, out)
    plot_timeline(runs, out)
    return text
