"""The planner's table (plan.md / plan.csv / plan.json) and figures (plan.png, scaling.png)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from parallel_lab.plan.predict import MODEL_STATE, RankPlan
from parallel_lab.plan.sizes import human

MiB = 2**20


def worst_rank(plans: list[RankPlan]) -> RankPlan:
    """The rank holding the most (the one that decides whether the strategy fits)."""
    return max(plans, key=lambda p: (p.total_bytes or 0, -p.rank))


def fit_text(plan: RankPlan, device_bytes: int) -> str:
    total = plan.total_bytes
    if total is None:
        return "no prediction"
    if total <= device_bytes:
        return f"fits ({100 * total / device_bytes:.1f}% of {human(device_bytes)})"
    return f"does not fit: needs {human(total)}, has {human(device_bytes)}"


def summary_row(plans: list[RankPlan], device_bytes: int) -> dict:
    """One (strategy, world) as one row: its worst rank, and how far the ranks differ."""
    worst = worst_rank(plans)
    state = worst.state or {}
    states = [p.model_state_bytes for p in plans if p.model_state_bytes is not None]
    comm = worst.comm or {}
    return {
        "strategy": worst.strategy,
        "world": worst.world_size,
        "rank": worst.rank,
        "params": worst.params,
        **{k: state.get(k) for k in MODEL_STATE},
        "comm_buffer_bytes": state.get("comm_buffer_bytes", 0) if worst.state else None,
        "activation_bytes": worst.activation_bytes,
        "micro_batch": worst.micro_batch,
        "recompute": worst.recompute,  # trainer.recompute (models/recompute.py)
        "recompute_bytes": worst.recompute_bytes,
        "total_bytes": worst.total_bytes,
        "rank_spread": (max(states) - min(states)) / max(states) if states and max(states) else 0.0,
        "max_model_state_bytes": max(states) if states else None,  # over the ranks (the scaling plot)
        "comm_bytes_per_step": sum(comm.values()) if worst.comm is not None else None,
        "comm_by_op": comm,
        "fits": fit_text(worst, device_bytes),
    }


def error_row(strategy: str, world: int, error: str) -> dict:
    return {"strategy": strategy, "world": world, "fits": f"cannot run: {error}"}


def _mib(value: float | None) -> str:
    """MiB with 4 significant digits, whole MiB with separators from 1,000 on."""
    if value is None:
        return ""
    mib = value / MiB
    return f"{mib:,.0f}" if abs(mib) >= 1000 else f"{mib:.4g}"


def write_markdown(rows: list[dict], path: Path, header: str) -> None:
    cols = ["strategy", "world", "worst rank", "params MiB", "master MiB", "grads MiB", "optim MiB",
            "comm buffers MiB", "activations MiB (micro-batch)", "total MiB", "ranks differ by",
            "comm MiB/step (by collective)", "fits?"]  # fmt: skip
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "total_bytes" not in r:
            lines.append(f"| {r['strategy']} | {r['world']} |" + " |" * (len(cols) - 3) + f" {r['fits']} |")
            continue
        mib = _mib
        ops = ", ".join(f"{op} {_mib(v)}" for op, v in sorted(r["comm_by_op"].items()))
        comm = "" if r["comm_bytes_per_step"] is None else _mib(r["comm_bytes_per_step"]) + (f" ({ops})" if ops else "")
        cells = [r["strategy"], r["world"], r["rank"], mib(r["param_bytes"]), mib(r["master_param_bytes"]),
                 mib(r["grad_bytes"]), mib(r["optim_bytes"]), mib(r["comm_buffer_bytes"]),
                 _activations_cell(r), mib(r["total_bytes"]),
                 f"{100 * r['rank_spread']:.2f}%", comm, r["fits"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def _activations_cell(r: dict) -> str:
    """'1.03 (16)'; with trainer.recompute, the mode and the recomputed region's bytes: '0.09 (16) + 0.24 full'."""
    cell = f"{_mib(r['activation_bytes'])} ({r['micro_batch']})"
    mode = r.get("recompute", "none")
    return cell if mode == "none" else f"{cell} + {_mib(r['recompute_bytes'])} {mode}"


def write_csv(rows: list[dict], path: Path) -> None:
    keys = ["strategy", "world", "rank", "params", *MODEL_STATE, "comm_buffer_bytes", "activation_bytes",
            "micro_batch", "recompute", "recompute_bytes", "total_bytes", "rank_spread", "comm_bytes_per_step",
            "fits"]  # fmt: skip
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_json(payload: dict, path: Path) -> None:
    path.write_text(json.dumps(payload, indent=1) + "\n")


def plot_bars(rows: list[dict], device_bytes: int, path: Path) -> None:
    """Per strategy, the worst rank's memory stacked by kind, against the device's memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("total_bytes") is not None]
    if not ok:
        return
    kinds = [*MODEL_STATE, "comm_buffer_bytes", "activation_bytes"]
    labels = [f"{r['strategy']}\nN={r['world']}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(ok)), 4.5))
    bottom = [0.0] * len(ok)
    for kind in kinds:
        values = [(r.get(kind) or 0) / MiB for r in ok]
        ax.bar(labels, values, bottom=bottom, label=kind.replace("_bytes", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(device_bytes / MiB, color="red", linestyle="--", label=f"device {human(device_bytes)}")
    ax.set_ylabel("MiB per rank (worst rank)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    plt.xticks(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(rows: list[dict], measured: list[dict], path: Path) -> None:
    """Per-rank model-state bytes (the rank holding the most) vs world size, log-log: predicted lines, measured
    points (metrics.json: the rank holding the most)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    strategies = sorted({r["strategy"] for r in rows if r.get("max_model_state_bytes") is not None})
    colors = {s: plt.cm.tab20(i % 20) for i, s in enumerate(strategies)}
    for s in strategies:
        pts = sorted(
            (r["world"], r["max_model_state_bytes"])
            for r in rows
            if r["strategy"] == s and r.get("max_model_state_bytes") is not None
        )
        ax.plot(
            [p[0] for p in pts],
            [p[1] / MiB for p in pts],
            "-",
            color=colors[s],
            label=s,
            marker="." if len(pts) < 3 else None,
        )
    for m in measured:
        if m["strategy"] in colors:
            ax.plot(m["world"], m["model_state_bytes"] / MiB, "o", color=colors[m["strategy"]], mfc="none", ms=9, mew=2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("model state per rank, MiB (the rank holding the most)")
    ax.set_title("lines: predicted; circles: measured (metrics.json)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
