"""The report's pictures: comparison.png (throughput, model state per rank) and
comparison_parity.png (each row's divergence from single against the noise envelope)."""

from __future__ import annotations

from pathlib import Path

from parallel_lab.report.parity import EARLY_STEPS, ENVELOPE_MULTIPLE
from parallel_lab.report.table import MiB, Row, _max_rank


def plot_comparison(runs: list[Row], out: Path) -> None:
    plt = _pyplot()
    ok = [r for r in runs if r.ok and not r.is_noise]
    if plt is None or not ok:
        return
    labels = [f"{r.metrics.strategy}\n{r.variant}\n×{r.metrics.world_size}".replace("\n\n", "\n") for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ok)), 4))
    axes[0].bar(labels, [r.metrics.samples_per_s for r in ok], color="tab:blue")
    axes[0].set_title("throughput (samples/s)")
    bottom = [0.0] * len(ok)
    for key, color in (("param_bytes", "tab:green"), ("grad_bytes", "tab:orange"), ("optim_bytes", "tab:red")):
        heights = [(_max_rank(r, key) or 0) / MiB for r in ok]
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


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
