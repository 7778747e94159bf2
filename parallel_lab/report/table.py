"""Turn metrics.json files into the comparison: comparison.md/.csv/.json (+ .png plots, ``plots.py``).

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

from parallel_lab.protocol import FAILED_FILE, METRICS_FILE, PARAMS_FILE
from parallel_lab.worker.metrics import load_final_params
from parallel_lab.report.parity import EARLY_STEPS, ENVELOPE_MULTIPLE, FLOOR_ULPS, NOISE_SEEDS, envelope, gaps, judge

MiB = 1024 * 1024
NOISE_HINT = ("run the comparison as a sweep that includes strategy=single (python -m parallel_lab -m "
              "strategy=single,...): it reruns the baseline with trainer.ulp_jitter_seed=1,2 for the noise floor")


def load_runs(dirs: list[Path]) -> list[dict]:
    runs = []
    for top in dirs:
        for path in sorted(top.rglob(METRICS_FILE)) + sorted(top.rglob(FAILED_FILE)):
            run = json.loads(path.read_text())
            run["run_dir"] = str(path.parent)
            runs.append(run)
    return sorted(runs, key=lambda r: (r.get("ulp_jitter_seed") is not None, r["run_dir"]))


def baseline_key(run: dict) -> tuple:
    """Runs that train the same thing (and so compare with one single baseline)."""
    return (run.get("model"), run.get("global_batch"), run.get("steps"), run.get("data"), run.get("optimizer"),
            run.get("lr"))


def is_noise_run(run: dict) -> bool:
    return run.get("ulp_jitter_seed") is not None


def is_baseline(run: dict) -> bool:
    return run.get("strategy") == "single" and run["status"] == "ok" and not is_noise_run(run)


def _losses_params(run: dict) -> tuple[list[float], dict] | None:
    params = load_final_params(Path(run["run_dir"]))
    return None if params is None else (run["losses"], params)


def add_parity(runs: list[dict]) -> None:
    """Judge every ok run against the single baseline of the same setup and that baseline's
    noise-floor reruns (parallel_lab/parity.py): fills run["parity"] and run["parity_checks"]."""
    for key in {baseline_key(r) for r in runs}:
        group = [r for r in runs if baseline_key(r) == key]
        base = next((r for r in group if is_baseline(r)), None)
        noise = [r for r in group if is_noise_run(r) and r["status"] == "ok"]
        base_pair = _losses_params(base) if base else None
        noise_pairs = [p for p in map(_losses_params, noise) if p is not None]
        env = envelope([gaps(*n, *base_pair) for n in noise_pairs]) if base_pair and noise_pairs else None
        for run in group:
            _judge_one(run, base_pair, env)


def _judge_one(run: dict, base_pair, env) -> None:
    pair = _losses_params(run) if run["status"] == "ok" else None
    if run["status"] != "ok":
        run["parity"] = "failed"
    elif base_pair is None:
        run["parity"] = "no baseline"
    elif pair is None:
        run["parity"] = f"no {PARAMS_FILE}"
    elif env is None:
        run["parity"] = "no noise floor"
    else:
        row = gaps(*pair, *base_pair)
        verdict = judge(row, env, *base_pair)
        run["dloss_per_step"] = row.loss
        run["noise_envelope_per_step"] = env.loss
        run["parity_checks"] = verdict.as_dict()
        run["parity"] = "envelope" if is_noise_run(run) else ("pass" if verdict.passed else "FAIL")


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


def _check(name: str):
    """'divergence (ratio to the noise envelope)' of one parity check; a ratio above the multiple fails."""

    def read(run: dict) -> str | None:
        check = run.get("parity_checks", {}).get(name)
        return check and f"{_fmt(check['value']) or 0} ({check['ratio']:.2g}×)"

    return read


COLUMNS = [  # (header, how to read it from a run)
    ("strategy", lambda r: r.get("strategy") + (f" (noise seed {r['ulp_jitter_seed']})" if is_noise_run(r) else "")),
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
    ("early Δloss (×env)", _check("early_dloss")),
    ("max Δloss (×env)", _check("max_dloss")),
    ("θ rel L2 (×env)", _check("param_rel_l2")),
    ("max |Δθ| (×env)", _check("param_max_abs")),
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


def criterion_line(runs: list[dict]) -> str:
    """How parity was judged, and on which CPU kernels (the floats depend on them)."""
    cpus = sorted({r["cpu_capability"] for r in runs if r.get("cpu_capability")})
    return (f"Parity: each row vs `single`, against the noise envelope of `single` rerun with every initial weight "
            f"moved 1 ulp (seeds {', '.join(map(str, NOISE_SEEDS))}). Pass = every ratio ≤ {ENVELOPE_MULTIPLE:g}× "
            f"(Δloss over the first {EARLY_STEPS} steps and over the run, final parameters' relative L2 and max |Δθ|; "
            f"floor {FLOOR_ULPS} float32 ulps). CPU kernels: {', '.join(cpus) or 'unknown'}."
            + (f" No noise floor here: {NOISE_HINT}." if any(r.get("parity") == "no noise floor" for r in runs) else ""))


def markdown(runs: list[dict]) -> str:
    headers = [h for h, _ in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(runs)]
    return "\n".join(lines) + "\n\n" + criterion_line(runs) + "\n"


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
    from parallel_lab.report.plots import plot_comparison, plot_parity

    plot_comparison(runs, out)
    plot_parity(runs, out)
    return text


def summary_line(metrics_path: Path) -> str:
    run = json.loads(Path(metrics_path).read_text())
    return (
        f"{run['strategy']} x{run['world_size']} ({run['launcher']}, {run['backend']}, {run['device']}): "
        f"final loss {run['final_loss']:.4f}, {run['samples_per_s']:.0f} samples/s, "
        f"checksum {run['final_param_checksum']:.6f} -> {Path(metrics_path).parent}"
    )


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

