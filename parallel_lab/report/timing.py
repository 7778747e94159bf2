"""Every time figure of the comparison as a median with its 95% interval (``intervals.py``), each
row's "vs single" verdict, and its FLOPs and MFU against the machine's own measured peak.

The samples behind an interval: with ``trainer.rounds=R > 1`` (the sweep ran every strategy R
times in rotating order, ``cli/sweep.py``) one value per round, each round's own median step;
with one round, the run's per-step times after ``trainer.warmup_steps`` (the profile's parts:
its profiled steps). A row's ``timing`` holds them by name (``step_ms``, ``samples_per_s``,
``compute``, ``comm``, ``exposed_comm``), each taken when first read (``interval``);
``add_timing`` adds the verdicts and the FLOPs figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel_lab.protocol import RunMetrics
from parallel_lab.report.intervals import Interval, median_ci, verdict
from parallel_lab.report.rows import Row, baseline_key, is_baseline, precision_of

PEAK_FILE = "peak.json"  # in a sweep's folder: the peaks measured once for its rows (worker/metrics.py measure_peak)
PROFILE_PARTS = ("compute", "comm", "exposed_comm")  # the profile's parts shown with intervals


def _rounds(row: Row) -> list[RunMetrics]:
    return [row.metrics, *row.rounds]


def _kept_steps(m: RunMetrics) -> list[float]:
    """The per-step times the run's median was taken over (after the warm-up steps)."""
    warmup = m.warmup_steps or 0
    return m.step_times_s[warmup:] if len(m.step_times_s) > warmup else m.step_times_s


def step_ms(row: Row) -> Interval | None:
    """The step time's median and interval, in ms: over rounds, else over the run's steps."""
    if not row.ok:
        return None
    rounds = _rounds(row)
    if len(rounds) > 1:
        return median_ci([1000 * m.step_time_s for m in rounds], "rounds")
    return median_ci([1000 * t for t in _kept_steps(row.metrics)], "steps")


def _mean_over_ranks(m: RunMetrics, key: str, step: int | None = None) -> float | None:
    """The ranks' mean of one profiled part: of one traced step, or of their mean step (None: not profiled)."""
    ranks = [r for r in m.ranks if r.get("time_ms")]
    if not ranks:
        return None
    values = [r["time_ms"][key] if step is None else r["time_ms_steps"][step][key] for r in ranks]
    return sum(values) / len(values)


def profile_part(row: Row, key: str) -> Interval | None:
    """A profiled part's (compute, comm, exposed_comm ms) median and interval: over rounds (each
    round's mean traced step), else over the traced steps (each the ranks' mean; a record without
    its steps: the mean step, one sample)."""
    if not row.ok or _mean_over_ranks(row.metrics, key) is None:
        return None
    rounds = [m for m in _rounds(row) if _mean_over_ranks(m, key) is not None]
    if len(rounds) > 1:
        return median_ci([_mean_over_ranks(m, key) for m in rounds], "rounds")
    steps = min(len(r.get("time_ms_steps") or []) for r in row.metrics.ranks if r.get("time_ms"))
    if not steps:
        return median_ci([_mean_over_ranks(row.metrics, key)], "steps")
    return median_ci([_mean_over_ranks(row.metrics, key, i) for i in range(steps)], "steps")


def interval(run: Row, name: str) -> Interval | None:
    """One of the row's intervals by name (step_ms, samples_per_s or a PROFILE_PARTS key), taken
    once and kept in run.timing; None for a failed run or a part it has not (not profiled)."""
    if not run.ok:
        return None
    if name not in run.timing:
        if name == "step_ms":
            run.timing[name] = step_ms(run)
        elif name == "samples_per_s":  # global_batch / step time: the step's interval, inverted
            step = interval(run, "step_ms")
            run.timing[name] = step and step.map(lambda ms: run.metrics.global_batch / ms * 1000)
        else:
            run.timing[name] = profile_part(run, name)
    return run.timing[name]


def _find_peak(m: RunMetrics, peaks: list[dict]) -> dict | None:
    """The peak measured for this run's device kind, compute dtype and (CPU) threads per rank,
    weighted by the run's mix of kernels (blended_peak)."""
    kind = m.device.split(":")[0]
    for peak in peaks:
        same_threads = kind == "cuda" or peak["threads"] == m.threads
        if peak["device"].split(":")[0] == kind and peak["dtype"] == precision_of(m) and same_threads:
            return blended_peak(peak, m.model_flops_by_kind)
    return None


def blended_peak(peak: dict, flops_by_kind: dict[str, float] | None) -> dict:
    """The peak a model with this mix of convolution and matrix-product FLOPs could reach: each
    kind's FLOPs at its own kernel's measured peak, F / sum(F_k / peak_k). The faster kernel alone
    overstates it for a model that does not run it: on a GPU, fp32 convolutions run in TF32
    (cuDNN's default) and matmuls not, 5x apart, and a vit is all matmuls. Without the split (a
    record from before it was kept) the faster kernel's peak, as before."""
    rates = {"conv": peak["conv_gflops"], "matmul": peak["matmul_gflops"]}
    total = sum((flops_by_kind or {}).values())
    if not total:
        return peak
    seconds = sum(flops / rates[kind] for kind, flops in flops_by_kind.items() if flops)
    mix = ", ".join(f"{kind} {flops / total:.0%}" for kind, flops in flops_by_kind.items() if flops)
    return {**peak, "peak_gflops": total / seconds, "peak_mix": mix}


def add_timing(runs: list[Row], peaks: list[dict] | None = None) -> None:
    """Every finished row's verdict against the `single` baseline of the same setup and its
    GFLOP/s per rank, and, where peaks are given, its peak (what MFU divides by)."""
    for run in (r for r in runs if r.ok):
        m, step = run.metrics, interval(run, "step_ms")
        if m.model_flops_per_step and step is not None:
            run.gflops_per_rank = m.model_flops_per_step / m.world_size / (step.median / 1000) / 1e9
        if peaks is not None:
            run.peak = _find_peak(m, peaks)
    for run in runs:
        base = next((b for b in runs if is_baseline(b) and baseline_key(b) == baseline_key(run)), None)
        if run.ok and not run.is_noise and base is not None:
            mine, theirs = interval(run, "step_ms"), interval(base, "step_ms")
            run.vs_baseline = "baseline" if run is base else verdict(mine, theirs)


def mfu(run: Row) -> float | None:
    """Model FLOPs utilisation: the achieved GFLOP/s per rank over the peak of one rank's share of the machine."""
    if run.peak is None or run.gflops_per_rank is None:
        return None
    return run.gflops_per_rank / run.peak["peak_gflops"]


def timing_json(run: Row) -> dict:
    """What comparison.json's row adds: samples_per_s_ci95 and step_ms_ci95 as [low, high], the
    medians, how the intervals were taken, the verdict, FLOPs and MFU."""
    step, samples = interval(run, "step_ms"), interval(run, "samples_per_s")
    if step is None:  # a failed run, or one that timed no step
        return {}
    parts = {key: interval(run, key) for key in PROFILE_PARTS}
    return {
        "samples_per_s": samples.median,  # over rounds where there were several (each round's: round_step_s)
        "samples_per_s_ci95": samples.as_list(),
        "step_ms": step.median,
        "step_ms_ci95": step.as_list(),
        "interval": {"over": step.over, "n": step.n, "level": step.level, "method": METHOD},
        "round_step_s": [m.step_time_s for m in _rounds(run)],
        **{f"{key}_ms_ci95": part.as_list() for key, part in parts.items() if part is not None},
        "vs_single": run.vs_baseline,
        "gflops_per_rank": run.gflops_per_rank,
        "peak_gflops": run.peak and run.peak["peak_gflops"],
        "peak_mix": run.peak and run.peak.get("peak_mix"),
        "mfu": mfu(run),
    }


METHOD = "order-statistic interval of the median (distribution-free, binomial ranks)"


def read_peaks(dirs: list[Path]) -> list[dict]:
    """The peaks a sweep measured (PEAK_FILE in its folder), from every folder given."""
    found = [d / PEAK_FILE for d in dirs if (d / PEAK_FILE).is_file()]
    return [peak for path in found for peak in json.loads(path.read_text())]


def interval_note(runs: list[Row]) -> str:
    """The table's footnote on its intervals: the method, what the samples were, the level."""
    steps = [s for s in (interval(r, "step_ms") for r in runs if r.ok) if s is not None]
    if not steps:
        return ""
    overs = [
        f"{n} {over} (holds the median {level:.1%})" if n > 1 else f"1 {over.rstrip('s')} (no interval)"
        for n, over, level in sorted({(s.n, s.over, s.level) for s in steps})
    ]
    return (
        f"Times: median (interval) over {', '.join(overs)}: the {METHOD}, 95% from 6 samples on, "
        "below that the range at its own level (docs/results.md). "
        "vs single: faster/slower only where the step-time intervals do not overlap. "
        "MFU: model FLOPs (forward ×3) per rank per second over the machine's own peak "
        "(python -m parallel_lab.bench peak) in the run's dtype with a rank's threads, its conv and "
        "matmul peaks weighted by the model's FLOPs in each."
    )
