"""The report's pictures: comparison.png (throughput, model state per rank),
comparison_parity.png (each row's divergence from single against the noise envelope) and, for runs
with trainer.profile, timeline.png (one profiled step, one lane per rank, coloured by where the time
went: worker/timeline.py)."""

from __future__ import annotations

from pathlib import Path

from parallel_lab.protocol import trace_files
from parallel_lab.report.columns import MiB, max_rank
from parallel_lab.report.intervals import Interval
from parallel_lab.report.parity import EARLY_STEPS, ENVELOPE_MULTIPLE
from parallel_lab.report.rows import Row
from parallel_lab.report.timing import interval
from parallel_lab.worker import timeline

# What each part of a step looks like in timeline.png; "comm in flight" is drawn thin, under the lane.
TIMELINE_COLORS = {
    "compute": "tab:blue",
    "exposed_comm": "tab:red",
    "idle": "tab:gray",
    "optimizer": "tab:green",
    "other": "gold",
}
SAME_CLOCK_US = 1e6  # ranks whose step starts lie further apart than this are on different clocks (hosts)


def plot_comparison(runs: list[Row], out: Path) -> None:
    plt = _pyplot()
    ok = [r for r in runs if r.ok and not r.is_noise]
    if plt is None or not ok:
        return
    labels = [f"{r.metrics.strategy}\n{r.variant}\n×{r.metrics.world_size}".replace("\n\n", "\n") for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ok)), 4))
    rates = [interval(r, "samples_per_s") or Interval(0.0, 0.0, 0.0, 0, 0.0) for r in ok]
    medians = [t.median for t in rates]
    errors = [[t.median - t.low for t in rates], [t.high - t.median for t in rates]]
    axes[0].bar(labels, medians, yerr=errors, capsize=4, color="tab:blue", ecolor="black")
    axes[0].set_title("throughput (samples/s): median and its interval")
    bottom = [0.0] * len(ok)
    for key, color in (("param_bytes", "tab:green"), ("grad_bytes", "tab:orange"), ("optim_bytes", "tab:red")):
        heights = [(max_rank(r, key) or 0) / MiB for r in ok]
        axes[1].bar(labels, heights, bottom=bottom, label=key.split("_")[0], color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes[1].set_title("model state per rank (MiB)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "comparison.png", dpi=100)
    plt.close(fig)


def plot_parity(runs: list[Row], out: Path) -> None:
    """comparison_parity.png: each row's |Δloss| vs single per step (log scale), with the noise
    envelope and the pass bound (ENVELOPE_MULTIPLE x envelope + floor) drawn."""
    judged = [r for r in runs if r.dloss_per_step and not r.is_noise and r.metrics.strategy != "single"]
    plt = _pyplot()
    if plt is None or not judged:
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    tiny = 1e-9  # log axes cannot show 0: an exact match is drawn at this height
    for run in judged:
        ax.plot(
            [max(v, tiny) for v in run.dloss_per_step],
            marker=".",
            label=" ".join(filter(None, (run.metrics.strategy, run.variant))) + f"×{run.metrics.world_size}",
        )
    env, floor = judged[0].noise_envelope_per_step, judged[0].parity_checks["max_dloss"]["floor"]
    steps = range(len(env))
    ax.fill_between(steps, tiny, [max(v, tiny) for v in env], color="grey", alpha=0.3, label="noise envelope")
    early = min(EARLY_STEPS, len(env))  # the bound judge() applies: early window, then the whole run
    bound = [ENVELOPE_MULTIPLE * max(env[:early] if t < early else env) + floor for t in steps]
    ax.step(steps, bound, "k--", where="mid", label=f"pass bound ({ENVELOPE_MULTIPLE:g}× envelope + floor)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("|loss − single loss|")
    ax.set_title("divergence from single vs the measured noise floor")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(out / "comparison_parity.png", dpi=100)
    plt.close(fig)


def _step_lanes(run_dir: str) -> list[tuple[int, dict, tuple[float, float]]]:
    """(rank, parts, window) of one profiled step on every rank: the step whose length on rank 0
    is the median of the profiled steps (a typical step, not the first or an outlier)."""
    per_rank = [timeline.load_events(path) for path in trace_files(run_dir)]
    windows = [timeline.step_windows(events) for events in per_rank]
    if not windows or not all(windows):
        return []
    lengths = [b - a for _, (a, b) in windows[0]]
    index = sorted(range(len(lengths)), key=lengths.__getitem__)[(len(lengths) - 1) // 2]
    lanes = []
    for rank, (events, steps) in enumerate(zip(per_rank, windows)):
        tid, window = steps[min(index, len(steps) - 1)]
        lanes.append((rank, timeline.classify_step(events, tid, window), window))
    return lanes


def _origin(lanes: list) -> list[float]:
    """Each lane's time zero: the earliest step start of the run, so the ranks' lanes line up on one
    axis (traces of one host share a clock); a rank on another clock starts at its own step."""
    first = min(window[0] for _, _, window in lanes)
    return [first if window[0] - first < SAME_CLOCK_US else window[0] for _, _, window in lanes]


def plot_timeline(runs: list[Row], out: Path) -> None:
    """timeline.png: for every profiled run, one lane per rank of one profiled step, each interval
    coloured compute / exposed comm / idle / optimizer / other, communication in flight drawn thin
    under the lane (under blue it was hidden); one time axis for every strategy, in ms."""
    rows = [(r, _step_lanes(r.run_dir)) for r in runs if r.ok and not r.is_noise]
    rows = [(r, lanes) for r, lanes in rows if lanes]
    plt = _pyplot()
    if plt is None or not rows:
        return
    height = sum(len(lanes) for _, lanes in rows)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * height))
    y, ticks, labels = 0, [], []
    for run, lanes in reversed(rows):
        label = " ".join(filter(None, (run.metrics.strategy, run.variant)))
        for (rank, parts, _), zero in reversed(list(zip(lanes, _origin(lanes)))):
            for key, color in TIMELINE_COLORS.items():
                bars = [((a - zero) / 1000, (b - a) / 1000) for a, b in parts[key]]
                ax.broken_barh(bars, (y + 0.3, 0.6), color=color, label=key.replace("_", " "))
            ax.broken_barh(
                [((a - zero) / 1000, (b - a) / 1000) for a, b in parts["comm"]], (y, 0.2), color="tab:orange"
            )
            ticks.append(y + 0.5)
            labels.append(f"{label} r{rank}")
            y += 1
        ax.axhline(y - 0.05, color="black", linewidth=0.5)
    ax.broken_barh([], (0, 0), color="tab:orange", label="comm in flight (any thread)")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=6, fontsize="small")
    ax.set_yticks(ticks, labels, fontsize="small")
    ax.set_xlabel("ms since the step began (one profiled step, trainer.profile)")
    ax.set_title("where each rank's step goes: thin orange under blue = communication hidden behind compute")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=100)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
