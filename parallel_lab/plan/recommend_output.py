"""The recommender's table (recommend.md) and record (recommend.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from parallel_lab.plan.output import human

COLUMNS = ["rank", "overrides", "predicted samples/s (interval)", "step ms", "peak per rank / cap", "why not first"]


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def row_cells(r, cap_bytes: int) -> list[str]:
    """One candidate as table cells (``r``: recommend.Ranked)."""
    low, high = r.samples_per_s_interval
    peak = "?" if r.peak_bytes is None else f"{human(r.peak_bytes)} / {human(cap_bytes)}"
    timed = math.isfinite(r.step_s)  # over the cap or no communication rule: not predicted
    return [
        str(r.rank) if r.rank else "-",
        "`" + r.candidate.label + "`",
        f"{_num(r.samples_per_s)} ({_num(low)}–{_num(high)})" if timed else "?",
        f"{1000 * r.step_s:.2f}" if timed else "?",
        peak,
        r.why,
    ]


def markdown(rec) -> str:
    """The header and every candidate, the recommendation first (``rec``: recommend.Recommendation)."""
    lines = [rec.header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r, rec.cap_bytes)) + " |" for r in rec.ranked]
    return "\n".join(lines) + "\n"


def write_recommendation(rec, out: Path) -> None:
    (out / "recommend.md").write_text(markdown(rec))
    payload = {
        "header": rec.header,
        "device_memory_bytes": rec.cap_bytes,
        "device_memory_source": rec.cap_source,
        "seconds": rec.seconds,
        "candidates": [r.to_json() for r in rec.ranked],
    }
    (out / "recommend.json").write_text(json.dumps(payload, indent=1) + "\n")
