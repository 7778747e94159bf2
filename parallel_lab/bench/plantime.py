"""Step time per strategy at world 2: predicted from this machine's calibration, against real runs.

    python -m parallel_lab.bench plantime [--model cnn] [--steps 20] [--repeats 3]
                                          [--strategies ddp fsdp ...] [--calibration calib.json]
                                          [--out plantime.json] [--replay plantime.json]

1. Communication: the collectives benchmark (gloo, and the hand-written ring manual_ddp uses) at
   4 KiB..16 MiB, fitted per collective to alpha + bytes / beta (``parallel_lab.plan.steptime``).
   ``--calibration`` reuses a file a previous run (``--out``) or ``bench collectives --json`` wrote.
2. Compute: ``strategy=single world_size=1`` (one process, one thread) at the world-2 micro-batch
   and at the whole global batch: forward+backward = fixed + per-sample x samples; optimizer per
   parameter.
3. Every strategy at world 2 through the real CLI, ``--repeats`` times, interleaved with the
   compute calibration so drifting machine load hits all of them alike; the median step time of
   rank 0 (metrics.json ``step_time_s``, after warm-up) is compared with the predicted interval
   [full overlap, no overlap]. ``--replay`` predicts again from a saved ``--out`` (no runs).

Prints the table docs/plan.md shows, with the 1-minute load average measured during the runs:
the machine may be shared, and a busy neighbour moves every measured number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from parallel_lab.plan.steptime import AlphaBeta, Compute, StepPrediction, fit_alpha_beta, fit_compute, predict_step


def multi_process_strategies() -> list[str]:
    """Every registered strategy that runs one process per rank (the step-time model's subjects)."""
    from parallel_lab.strategies import get_strategy_class, sweep_names

    return [name for name in sweep_names() if not get_strategy_class(name).plan.single_process]


def collectives_calibration(path: Path) -> dict:
    """Run ``bench collectives`` (2 ranks, gloo + hand) into ``path`` and return what it wrote."""
    cmd = [sys.executable, "-m", "parallel_lab.bench", "collectives", "--np", "2", "--impls", "gloo", "hand",
           "--min-bytes", "4K", "--max-bytes", "16M", "--max-iters", "50", "--json", str(path)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def alpha_beta_fits(collectives: dict) -> dict[str, dict[str, AlphaBeta]]:
    """impl -> op -> the alpha-beta fit of that collective's (bytes, seconds per call) rows."""
    fits: dict[str, dict[str, AlphaBeta]] = {}
    for impl in collectives["impls"]:
        for op in sorted({r["op"] for r in collectives["rows"]}):
            points = [(r["bytes"], r[impl]) for r in collectives["rows"] if r["op"] == op and impl in r]
            fits.setdefault(impl, {})[op] = fit_alpha_beta(points)
    return fits


def run_once(common: list[str], extra: list[str], workdir: Path, timeout: float) -> dict:
    from parallel_lab.cli.run import run_cli_metrics

    load = os.getloadavg()[0]
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    metrics = run_cli_metrics(run_dir, *common, *extra, timeout=timeout)
    return {
        "step_s": metrics["step_time_s"],
        "fwd_bwd_s": metrics["step_split_s"]["fwd_bwd"],
        "optimizer_s": metrics["step_split_s"]["optimizer"],
        "params": metrics["params"],
        "loadavg_1m": load,
    }


def measure(args, workdir: Path) -> dict[str, list[dict]]:
    """Calibration runs (``single@<batch>``) and every strategy, ``args.repeats`` rounds, interleaved."""
    common = [f"model={args.model}", f"trainer.steps={args.steps}", "trainer.eval_batches=0"]
    small = args.global_batch // 2
    runs = {
        f"single@{small}": ["strategy=single", "world_size=1", f"trainer.global_batch={small}"],
        f"single@{args.global_batch}": ["strategy=single", "world_size=1", f"trainer.global_batch={args.global_batch}"],
        **{s: [f"strategy={s}", "world_size=2", f"trainer.global_batch={args.global_batch}"] for s in args.strategies},
    }
    out: dict[str, list[dict]] = {name: [] for name in runs}
    for round_ in range(args.repeats):
        for name, extra in runs.items():
            out[name].append(run_once(common, extra, workdir, args.timeout))
            print(f"round {round_ + 1}/{args.repeats} {name}: {out[name][-1]['step_s'] * 1e3:.1f} ms", file=sys.stderr)
    return out


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def compute_fit(args, measured: dict[str, list[dict]]) -> Compute:
    """The line through the medians of the two one-rank calibrations."""
    small, large = measured[f"single@{args.global_batch // 2}"], measured[f"single@{args.global_batch}"]
    return fit_compute(
        (args.global_batch // 2, median(small, "fwd_bwd_s")),
        (args.global_batch, median(large, "fwd_bwd_s")),
        median(small + large, "optimizer_s"),
        large[0]["params"],
    )


def predictions(args, measured: dict[str, list[dict]], fits: dict) -> dict[str, StepPrediction]:
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.configs import planned_configs
    from parallel_lab.strategies import get_strategy_class

    compute = compute_fit(args, measured)
    out = {}
    for name in args.strategies:
        (planned,) = planned_configs(
            [f"strategy={name}", f"model={args.model}", "world_size=2", f"trainer.global_batch={args.global_batch}"]
        )
        cfg = planned.cfg
        out[name] = predict_step(cfg, get_strategy_class(name), build_meta_model(cfg.model), compute, fits)
    return out


def round_of(measured: dict[str, list[dict]], r: int) -> dict[str, list[dict]]:
    """Round r's runs only: its calibration ran minutes, not tens of minutes, from its strategies."""
    return {name: [runs[r]] for name, runs in measured.items()}


def table(args, fits: dict, measured: dict[str, list[dict]]) -> str:
    """Pooled: the prediction from the median calibration against the median run. Per round: each
    round's prediction from that round's own calibration against that round's run (the machine's
    load moves between rounds; within one, calibration and runs saw about the same)."""
    rounds = len(next(iter(measured.values())))
    pooled = predictions(args, measured, fits)
    per_round = [predictions(args, round_of(measured, r), fits) for r in range(rounds)]
    lines = [
        "| strategy | predicted fwd+bwd / optimizer ms | predicted comm ms (by collective) "
        "| predicted step ms [full overlap, no overlap] | measured step ms (median; min-max) "
        "| measured fwd+bwd / optimizer ms | error of no-overlap, pooled | error per round (own calibration) "
        "| inside interval (rounds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in pooled.items():
        runs = measured[name]
        m = median(runs, "step_s")
        comm = ", ".join(f"{op} {s * 1e3:.2f}" for op, s in sorted(p.comm_s.items())) or "none"
        errs = [(pr[name].upper_s - run["step_s"]) / run["step_s"] for pr, run in zip(per_round, runs)]
        inside = sum(
            pr[name].lower_s * 0.999 <= run["step_s"] <= pr[name].upper_s * 1.001 for pr, run in zip(per_round, runs)
        )
        lines.append(
            f"| {name} | {p.fwd_bwd_s * 1e3:.1f} / {p.optimizer_s * 1e3:.1f} | {comm} "
            f"| {p.upper_s * 1e3:.1f} [{p.lower_s * 1e3:.1f}, {p.upper_s * 1e3:.1f}] "
            f"| {m * 1e3:.1f} ({min(r['step_s'] for r in runs) * 1e3:.1f}-{max(r['step_s'] for r in runs) * 1e3:.1f}) "
            f"| {median(runs, 'fwd_bwd_s') * 1e3:.1f} / {median(runs, 'optimizer_s') * 1e3:.1f} "
            f"| {100 * (p.upper_s - m) / m:+.0f}% | {', '.join(f'{100 * e:+.0f}%' for e in errs)} "
            f"(median {100 * statistics.median(errs):+.0f}%) | {inside}/{rounds} |"
        )
    loads = [
        statistics.median(r["loadavg_1m"] for runs in round_of(measured, i).values() for r in runs)
        for i in range(rounds)
    ]
    lines.append(f"\n1-min load average at run starts, per round: {', '.join(f'{x:.2f}' for x in loads)}")
    return "\n".join(lines)


def fits_table(fits: dict[str, dict[str, AlphaBeta]]) -> str:
    lines = ["| impl | collective | alpha us | beta GB/s |", "|---|---|---|---|"]
    for impl, by_op in fits.items():
        for op, f in by_op.items():
            lines.append(f"| {impl} | {op} | {f.alpha_s * 1e6:.0f} | {f.beta_Bps / 1e9:.2f} |")
    return "\n".join(lines)


def calibrate_and_run(args) -> tuple[dict, dict, tuple, tuple]:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_plantime_") as workdir:
        if args.calibration:
            saved = json.loads(args.calibration.read_text())
            collectives = saved.get("collectives", saved)
        else:
            collectives = collectives_calibration(Path(workdir) / "collectives.json")
        measured = measure(args, Path(workdir))
    return collectives, measured, load_before, os.getloadavg()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench plantime", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="cnn", choices=("cnn", "resnet18"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    strategies = multi_process_strategies()
    parser.add_argument("--strategies", nargs="+", default=strategies, choices=strategies)
    parser.add_argument("--calibration", type=Path, help="a json with the collectives rows (skips that benchmark)")
    parser.add_argument("--out", type=Path, help="write calibration, runs and predictions here (json)")
    parser.add_argument("--replay", type=Path, help="a saved --out: predict again from its calibration and runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a hung run is killed")
    args = parser.parse_args(argv)
    if args.global_batch % 4:
        parser.error(f"--global-batch {args.global_batch} must be a multiple of 4 (halved, then split over 2 ranks)")
    if args.replay:
        saved = json.loads(args.replay.read_text())
        collectives, measured = saved["collectives"], saved["runs"]
        load_before, load_after = saved["loadavg"]["before"], saved["loadavg"]["after"]
        for key, value in saved.get("args", {}).items():  # the saved run's model and batch, not the defaults
            setattr(args, key, value)
        args.strategies = [s for s in args.strategies if s in measured]
    else:
        collectives, measured, load_before, load_after = calibrate_and_run(args)
    fits = alpha_beta_fits(collectives)
    preds = predictions(args, measured, fits)
    loads = [r["loadavg_1m"] for runs in measured.values() for r in runs]
    print(
        f"step time at world 2, {args.model}, global batch {args.global_batch}, {args.steps} steps, "
        f"median of {args.repeats} runs each (rank 0, after warm-up); 1 thread per rank on "
        f"{os.cpu_count()} CPUs; 1-min load average {load_before[0]:.2f} before, "
        f"{statistics.median(loads):.2f} median / {max(loads):.2f} max at run starts, {load_after[0]:.2f} after"
    )
    c = compute_fit(args, measured)
    print(
        f"\ncompute (strategy=single world_size=1, 1 thread): forward+backward = {c.fixed_s * 1e3:.2f} ms + "
        f"{c.per_sample_s * 1e3:.3f} ms x samples; optimizer {c.per_param_s * 1e9:.2f} ns per parameter"
    )
    print(f"\ncommunication (alpha-beta per call, fitted to bench collectives at world 2):\n{fits_table(fits)}\n")
    print(table(args, fits, measured))
    if args.out:
        payload = {
            "collectives": collectives,
            "runs": measured,
            "loadavg": {"before": load_before, "after": load_after},
            "predicted": {
                n: {
                    "lower_s": p.lower_s,
                    "upper_s": p.upper_s,
                    "fwd_bwd_s": p.fwd_bwd_s,
                    "optimizer_s": p.optimizer_s,
                    "comm_s": p.comm_s,
                    "notes": p.notes,
                }
                for n, p in preds.items()
            },
            "args": {k: getattr(args, k) for k in ("model", "steps", "global_batch", "repeats")},
        }
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0
