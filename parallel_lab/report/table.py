"""Turn metrics.json files into the comparison: comparison.md/.csv/.json (the plots: ``plots.py``;
both: ``write.py``).

Every row carries its proof: the loss difference against the ``single`` baseline found among the
same runs (same model, global batch and steps), and a pass/fail parity mark (``rows.py``).
comparison.md shows what a reader compares (``MD_COLUMNS``, every number to ``DIGITS`` significant
digits); comparison.csv has every column (``COLUMNS``, ``columns.py``) unrounded, comparison.json
every record. Failed runs (failed.json) appear as rows with their error, and the rest of the report
still renders. Runs are read as the records the workers and the parent wrote
(``protocol.RunMetrics`` / ``FailedRun``).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from parallel_lab.protocol import RunMetrics
from parallel_lab.report.columns import (
    CHECKS,
    COLUMNS,
    CUDA_ALLOC,
    CUDA_RESERVED,
    MODEL_STATE_MIB,
    READ,
    MiB,
    finished_only,
    mark_variants,
    norm_cell,
    overlap_pct,
    rank_mean_time_ms,
    strategy_label,
)
from parallel_lab.report.parity import EARLY_STEPS, ENVELOPE_MULTIPLE, FLOOR_ULPS, NOISE_SEEDS

# What the callers of the comparison (cli/, tests) use lives in rows.py; named here too, where they import it from.
from parallel_lab.report.rows import DIFFERS, Row, add_parity, baseline_key, is_baseline, load_runs  # noqa: F401
from parallel_lab.report.timing import add_timing, interval, interval_note, mfu, timing_json

NOISE_HINT = (
    "run the comparison as a sweep that includes strategy=single (python -m parallel_lab -m "
    "strategy=single,...): it reruns the baseline for the noise floor (report/parity.py noise_reruns)"
)


def _md_strategy(run: Row) -> str:
    """The strategy cell of comparison.md: the label, and the norm where it is not GroupNorm
    ('ddp [batch (16)]'), so a BatchNorm row reads as what it is without a column of its own."""
    label = strategy_label(run)
    m = run.metrics
    return f"{label} [{norm_cell(m)}]" if run.ok and m.norm not in (None, "group") else label


def _exposed_comm(run: Row) -> str | None:
    """'exposed / total comm ms (overlap %)' of the profiled steps (worker/timeline.py): medians
    with their intervals, the overlap from the medians."""
    exposed, comm = interval(run, "exposed_comm"), interval(run, "comm")
    if exposed is None or comm is None:
        return None
    overlap = overlap_pct({"exposed_comm": exposed.median, "comm": comm.median})
    return f"{_with_interval(exposed)} / {_with_interval(comm)}" + ("" if overlap is None else f" ({_num(overlap)}%)")


def _with_interval(value) -> str:
    """'30.99 (30.51–31.60)': a median and its 95% interval (intervals.py); the median alone
    where one sample gave no interval."""
    if value.n < 2:
        return _num(value.median)
    return f"{_num(value.median)} ({_num(value.low)}–{_num(value.high)})"


def _time_cell(name: str):
    def read(run: Row) -> str | None:
        value = interval(run, name)
        return None if value is None else _with_interval(value)

    return read


def _flops_cell(run: Row) -> str | None:
    """'12.34 (6.1%)': model GFLOP/s per rank and the MFU against the measured peak ('?' without one)."""
    if run.gflops_per_rank is None:
        return None
    share = mfu(run)
    return f"{_num(run.gflops_per_rank)} ({'?' if share is None else _num(100 * share) + '%'})"


DIGITS = 4  # significant digits of every number in comparison.md


def _num(value: float) -> str:
    """comparison.md's one rule for a number: DIGITS significant digits with trailing zeros kept (each
    number shows its precision), thousands grouped and whole digits never rounded away; 0 is 0."""
    if value == 0:
        return "0"
    text = f"{value:#.{DIGITS}g}"
    if isinstance(value, int) or "e+" in text or text.endswith("."):  # a count, or 1000 and above
        return f"{value:,.0f}"
    return text


def _cell(value) -> str:
    if value is None:
        return ""
    return _num(value) if isinstance(value, (int, float)) else str(value)


def _joined(*reads):
    """'a / b / c': numbers to compare in one cell; '?' for a missing one, blank when the first is."""

    def read(run: Row) -> str | None:
        values = [r(run) for r in reads]
        return None if values[0] is None else " / ".join("?" if v is None else _num(v) for v in values)

    return read


def _world_cell(run: Row) -> str:
    """'4 (2×2)': the world size and how the launcher placed it, nodes × processes per node."""
    m = run.metrics
    placed = f" ({m.nodes}×{m.nproc_per_node})" if run.ok and m.nodes else ""
    return f"{run.record.world_size}{placed}{_world_changes(m) if run.ok else ''}"


def _world_changes(m: RunMetrics) -> str:
    """' [2→1 at step 20]': where an elastic run (or a reshard) changed its world or strategy."""
    ranges = getattr(m, "world_size_history", None) or []
    changes = [
        f"{a['world_size']}→{b['world_size']}"
        + (f" {a['strategy']}→{b['strategy']}" if a["strategy"] != b["strategy"] else "")
        + f" at step {b['from_step']}"
        for a, b in zip(ranges, ranges[1:])
    ]
    return f" [{'; '.join(changes)}]" if changes else ""


def _mesh_cell(m: RunMetrics) -> str | None:
    """'replicate 2 (1.226) × shard 2 (3.677)': the mesh and each dimension's MiB per step."""
    mesh = m.strategy_extras.get("mesh")
    per_dim = mesh and mesh["comm_bytes_per_step"]
    return mesh and " × ".join(f"{name} {size} ({_num(per_dim[name] / MiB)})" for name, size in mesh["dims"].items())


def _evidence(run: Row) -> str | None:
    """What the parity cell rests on: the check nearest its bound as 'name divergence (ratio to the
    noise envelope ×)' and whether the replicas ended bit-equal, the replicas that differ, or a
    failed run's error."""
    if run.failure:
        return run.failure.error
    verdict = run.parity_checks or {}
    if verdict.get("replicas_agree") is False:  # exact, and shown before any ratio: the ranks that differ
        groups = verdict["replicas_disagree"]
        return "; ".join(f"replicas differ: ranks {', '.join(map(str, g['ranks']))}" for g in groups)
    checks = [(label, run.parity_checks[name]) for name, label in CHECKS.items() if name in run.parity_checks]
    if not checks:
        return None
    label, check = max(checks, key=lambda c: c[1]["ratio"])
    same = "; replicas bit-equal" if verdict.get("replicas_agree") else ""  # None: nothing held twice
    return f"{label} {_num(check['value'])} ({_num(check['ratio'])}×){same}"


# comparison.md: what a reader compares, at most 16 columns; a column with a `shown` test appears
# only when some row passes it (CUDA memory: a GPU ran; the mesh; the hosts: more than one).
MD_COLUMNS = [  # (header, how to read it from a row, shown)
    ("strategy", _md_strategy, None),
    ("launcher", READ["launcher"], None),
    ("world (nodes×procs)", _world_cell, None),
    ("mesh (comm MiB/step per dim)", finished_only(_mesh_cell), READ["mesh"]),
    ("samples/s", _time_cell("samples_per_s"), None),
    ("step ms", _time_cell("step_ms"), None),
    ("vs single", READ["vs single"], None),
    ("GFLOP/s/rank (MFU)", _flops_cell, None),
    ("peak RSS MiB", READ["peak RSS MiB"], None),
    ("CUDA alloc/reserved MiB", _joined(CUDA_ALLOC, CUDA_RESERVED), lambda r: CUDA_ALLOC(r) is not None),
    ("model state MiB meas/plan/paper", _joined(*MODEL_STATE_MIB.values()), None),
    ("comm Ψ meas/theory", _joined(READ["comm Ψ measured"], READ["comm Ψ theory"]), None),
    ("inter-host MiB/step", READ["inter-host MiB/step"], lambda r: r.ok and (r.metrics.nodes or 1) > 1),
    (
        "exposed / comm ms (overlap)",
        _exposed_comm,
        lambda r: r.ok and rank_mean_time_ms(r.metrics) is not None,
    ),
    ("parity", READ["parity"], None),
    ("evidence", _evidence, None),
]


def md_columns(runs: list[Row]) -> list[tuple]:
    """MD_COLUMNS without the conditional ones no row calls for."""
    return [c for c in MD_COLUMNS if c[2] is None or any(c[2](run) for run in runs)]


def csv_rows(runs: list[Row]) -> list[list]:
    """Every column of every row, the values as read (comparison.csv)."""
    mark_variants(runs)
    add_timing(runs)
    return [[get(run) for _, get in COLUMNS] for run in runs]


def criterion_line(runs: list[Row]) -> str:
    """How parity was judged, and on which CPU kernels and GPUs (the floats depend on them)."""
    cpus = sorted(
        {
            " ".join([r.metrics.cpu_capability, *(f"{k}={v}" for k, v in r.metrics.kernel_dispatch.items())])
            for r in runs
            if r.ok and r.metrics.cpu_capability
        }
    )
    gpus = sorted({r.metrics.device_name for r in runs if r.ok and r.metrics.device_name})
    return (
        f"Parity: each row vs `single`, against the noise envelope of `single` rerun with the same training in "
        f"other last bits (weights moved 1 ulp, seeds {', '.join(map(str, NOISE_SEEDS))}; gradients moved by their "
        f"rounding; more micro-batches; another thread count). Pass = every ratio ≤ {ENVELOPE_MULTIPLE:g}× "
        f"(Δloss at each of the first {EARLY_STEPS} steps and over the run, final parameters' relative L2 and "
        f"max |Δθ|; "
        f"floor {FLOOR_ULPS} float32 ulps, under Adam one weight moved 2·lr·steps; bf16 rows against `single` "
        f"in bf16 and its own reruns). "
        f"CPU kernels: {', '.join(cpus) or 'unknown'}."
        + (f" GPU: {', '.join(gpus)}." if gpus else "")
        + (f" No noise floor here: {NOISE_HINT}." if any(r.parity == "no noise floor" for r in runs) else "")
    )


def markdown(runs: list[Row]) -> str:
    escape = lambda text: text.replace("|", "\\|")  # noqa: E731  ("max |Δθ|" must not split its column)
    mark_variants(runs)
    add_timing(runs)
    columns = md_columns(runs)
    lines = ["| " + " | ".join(escape(h) for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(escape(_cell(read(run))) for _, read, _ in columns) + " |" for run in runs]
    note = interval_note(runs)
    return "\n".join(lines) + "\n\n" + (note + "\n\n" if note else "") + criterion_line(runs) + "\n"


def write_tables(runs: list[Row], out: Path, peaks: list[dict] | None = None) -> str:
    """comparison.md, .csv and .json in out (the parity of every row judged first, its MFU against
    the peaks: worker/metrics.py measure_peak); returns the md."""
    add_parity(runs)
    add_timing(runs, peaks)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(runs)
    (out / "comparison.md").write_text(text)
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([h for h, _ in COLUMNS])
        writer.writerows(csv_rows(runs))
    (out / "comparison.json").write_text(json.dumps([run.to_json(timing_json(run)) for run in runs], indent=2) + "\n")
    return text


def summary_line(metrics_path: Path) -> str:
    m = RunMetrics.read(metrics_path)
    return (
        f"{m.strategy} x{m.world_size} ({m.launcher}, {m.backend}, {m.device}): "
        f"final loss {m.final_loss:.4f}, {m.samples_per_s:.0f} samples/s, "
        f"checksum {m.final_param_checksum:.6f} -> {Path(metrics_path).parent}"
    )
