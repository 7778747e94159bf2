"""Turn metrics.json files into the comparison: comparison.md/.csv/.json (+ .png plots).

    python -m parallel_lab.report <dir> [<dir> ...] [--out DIR]

Every row carries its proof: the loss difference against the ``single`` baseline found among the
same runs (same model, global batch and steps), and a pass/fail parity mark. Failed runs
(failed.json) appear as rows with their error, and the rest of the report still renders.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from parallel_lab.metrics import FAILED_FILE, METRICS_FILE

PARITY_RTOL = 1e-4  # relative loss difference vs single that still counts as "the same training"
MiB = 1024 * 1024


def load_runs(dirs: list[Path]) -> list[dict]:
    runs = []
    for top in dirs:
        for path in sorted(top.rglob(METRICS_FILE)) + sorted(top.rglob(FAILED_FILE)):
            run = json.loads(path.read_text())
            run["run_dir"] = str(path.parent)
            runs.append(run)
    return sorted(runs, key=lambda r: r["run_dir"])


def _baseline_key(run: dict) -> tuple:
    return (run.get("model"), run.get("global_batch"), run.get("steps"), run.get("data"))


def _max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def add_parity(runs: list[dict]) -> None:
    """Fill max_abs_dloss / max_rel_dloss / parity against the single run of the same setup."""
    baselines = {_baseline_key(r): r for r in runs if r.get("strategy") == "single" and r["status"] == "ok"}
    for run in runs:
        base = baselines.get(_baseline_key(run))
        if run["status"] != "ok" or base is None:
            run["parity"] = "failed" if run["status"] != "ok" else "no baseline"
            continue
        run["max_abs_dloss"] = max(abs(a - b) for a, b in zip(run["losses"], base["losses"]))
        run["max_rel_dloss"] = _max_rel_diff(run["losses"], base["losses"])
        run["parity"] = "pass" if run["max_rel_dloss"] <= PARITY_RTOL else "FAIL"


def _max_rank(run: dict, key: str) -> int | None:
    values = [r.get(key) for r in run.get("ranks", []) if r.get(key) is not None]
    return max(values) if values else None


def _mib(run: dict, key: str) -> float | None:
    value = _max_rank(run, key)
    return None if value is None else value / MiB


def _measured_vs_analytic(key: str):
    """'measured / analytic' MiB of one kind of model state, on the rank holding the most."""

    def read(run: dict) -> str | None:
        measured, analytic = _mib(run, key), _mib(run, f"analytic_{key}")
        if measured is None:
            return None
        return f"{_fmt(measured)} / {_fmt(analytic)}" if analytic is not None else _fmt(measured)

    return read


def _comm_psi(run: dict) -> str | None:
    if run.get("comm_volume_psi") is None:
        return None
    theory = run.get("comm_theory_psi")
    return f"{run['comm_volume_psi']:.2f} / {'?' if theory is None else f'{theory:g}'}"


COLUMNS = [  # (header, how to read it from a run)
    ("strategy", lambda r: r.get("strategy")),
    ("launcher", lambda r: r.get("launcher")),
    ("world", lambda r: r.get("world_size")),
    ("model", lambda r: r.get("model")),
    ("params", lambda r: r.get("params")),
    ("samples/s", lambda r: r.get("samples_per_s")),
    ("step ms", lambda r: r.get("step_time_s") and 1000 * r["step_time_s"]),
    ("fwd+bwd / opt ms", lambda r: r.get("step_split_s") and "{:.1f} / {:.1f}".format(
        1000 * r["step_split_s"]["fwd_bwd"], 1000 * r["step_split_s"]["optimizer"])),
    ("peak RSS MiB", lambda r: _mib(r, "peak_rss_bytes")),
    ("CUDA alloc/reserved MiB", lambda r: _mib(r, "cuda_max_allocated_bytes") is not None and "{:.1f} / {:.1f}".format(
        _mib(r, "cuda_max_allocated_bytes"), _mib(r, "cuda_max_reserved_bytes"))),
    ("params MiB meas/analytic", _measured_vs_analytic("param_bytes")),
    ("grads MiB meas/analytic", _measured_vs_analytic("grad_bytes")),
    ("optim MiB meas/analytic", _measured_vs_analytic("optim_bytes")),
    ("comm MiB/step", lambda r: r.get("comm_bytes_per_step") is not None and r["comm_bytes_per_step"] / MiB),
    ("comm Ψ meas/theory", _comm_psi),
    ("final loss", lambda r: r.get("final_loss")),
    ("max Δloss", lambda r: r.get("max_abs_dloss")),
    ("parity", lambda r: r.get("parity")),
    ("error", lambda r: r.get("error", "")),
]


def _fmt(value) -> str:
    if value is None or value is False:
        return ""
    if isinstance(value, float) and value == 0:
        return "0"
    if isinstance(value, float):
        if abs(value) < 1e-2:
            return f"{value:.2g}"
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def table_rows(runs: list[dict]) -> list[list[str]]:
    return [[_fmt(get(run)) for _, get in COLUMNS] for run in runs]


def markdown(runs: list[dict]) -> str:
    headers = [h for h, _ in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(runs)]
    return "\n".join(lines) + "\n"


def write_report(runs: list[dict], out: Path) -> str:
    add_parity(runs)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(runs)
    (out / "comparison.md").write_text(text)
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([h for h, _ in COLUMNS])
        writer.writerows(table_rows(runs))
    (out / "comparison.json").write_text(json.dumps(runs, indent=2) + "\n")
    _plot(runs, out)
    return text


def _plot(runs: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return
    labels = [f"{r['strategy']}\n×{r['world_size']}" for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(ok)), 4))
    axes[0].bar(labels, [r["samples_per_s"] for r in ok], color="tab:blue")
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


def summary_line(metrics_path: Path) -> str:
    run = json.loads(Path(metrics_path).read_text())
    return (
        f"{run['strategy']} x{run['world_size']} ({run['launcher']}, {run['backend']}, {run['device']}): "
        f"final loss {run['final_loss']:.4f}, {run['samples_per_s']:.0f} samples/s, "
        f"checksum {run['final_param_checksum']:.6f} -> {Path(metrics_path).parent}"
    )


class SweepReport(Callback):
    """Hydra callback: write and print the comparison at the end of every --multirun sweep."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = load_runs([sweep_dir])
        if runs:
            print(write_report(runs, sweep_dir))
            print(f"report: {sweep_dir}/comparison.md (.csv .json .png)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run or sweep folders holding metrics.json files")
    parser.add_argument("--out", type=Path, default=None, help="where to write comparison.* (default: first dir)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        print(f"parallel_lab.report: error: not a folder: {', '.join(missing)}; pass run or sweep folders", file=sys.stderr)
        return 2
    runs = load_runs(args.dirs)
    if not runs:
        print(f"parallel_lab.report: error: no {METRICS_FILE} under {', '.join(map(str, args.dirs))}; run a sweep first", file=sys.stderr)
        return 2
    print(write_report(runs, args.out or args.dirs[0]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
