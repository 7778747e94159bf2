"""The end of a sweep: run its later timing rounds (``trainer.rounds``), rerun the baseline for the
noise floor, measure the machine's peak FLOP/s, then write and print the comparison, and hand back
the rows whose parity is not proven (the command exits non-zero for them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from parallel_lab.protocol import CONFIG_FILE, METRICS_FILE
from parallel_lab.report.intervals import rotation
from parallel_lab.report.parity import noise_reruns
from parallel_lab.report.rows import ROUNDS_DIR, precision_of
from parallel_lab.report.table import DIFFERS, Row, baseline_key, is_baseline, load_runs
from parallel_lab.report.timing import PEAK_FILE
from parallel_lab.report.write import write_report
from parallel_lab.worker.metrics import peaks_for

NOISE_DIR = "noise_floor"
RunOne = Callable[[DictConfig, Path], int]  # one run from its config (cli/main.py's run_one)


def _config_of(run: Row) -> DictConfig:
    """A run's resolved config.yaml, to run the same again (no checkpoints: a rerun trains afresh)."""
    cfg = OmegaConf.load(Path(run.run_dir) / CONFIG_FILE)
    cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_dir = 0, None
    return cfg


def run_rounds(runs: list[Row], sweep_dir: Path, run_one: RunOne) -> None:
    """Rounds 1 .. trainer.rounds - 1 of the sweep's finished runs (round 0 was the sweep itself):
    each round runs every one once, round r in the order rotated to start at the r-th (mod n), so a
    drift in the machine's load falls on every strategy alike; into <sweep>/rounds/r<k>/<run folder>."""
    timed = [r for r in runs if r.ok and not r.is_noise]
    rounds = {r.run_dir: _config_of(r).trainer.get("rounds", 1) for r in timed}
    for k in range(1, max(rounds.values(), default=1)):
        for run in rotation(timed, k):
            out = sweep_dir / ROUNDS_DIR / f"r{k}" / Path(run.run_dir).name
            if rounds[run.run_dir] > k and not (out / METRICS_FILE).is_file():
                run_one(_config_of(run), out)


def run_noise_floor(runs: list[Row], sweep_dir: Path, run_one: RunOne) -> None:
    """Rerun every baseline of the sweep once per noise_reruns() perturbation (the same training in
    other last bits, report/parity.py), through the same launcher as any run. One baseline per
    baseline_key, which includes the precision: a bf16 `single` gets its own reruns (bf16 rows'
    envelope), beside the fp32 one's."""
    done = {(baseline_key(r), r.metrics.noise_rerun) for r in runs if r.is_noise}
    for base in (r for r in runs if is_baseline(r)):
        m = base.metrics
        batch_statistics = m.norm != "group"  # BatchNorm: micro-batches would change the function
        for label, changes in noise_reruns(m.global_batch, m.grad_accum, m.threads, batch_statistics).items():
            if (baseline_key(base), label) in done:
                continue
            done.add((baseline_key(base), label))
            cfg = _config_of(base)
            cfg.trainer.update(changes, noise_rerun=label)
            run_one(cfg, sweep_dir / NOISE_DIR / f"{Path(base.run_dir).name}_{label.replace('=', '')}")


def measure_peaks(runs: list[Row], sweep_dir: Path) -> list[dict]:
    """The machine's peak GFLOP/s once per (device kind, compute dtype, threads per rank) of the
    sweep's rows (worker/metrics.py peaks_for), kept in <sweep>/peak.json for a later render."""
    wanted = {
        (r.metrics.device.split(":")[0], precision_of(r.metrics), r.metrics.threads)
        for r in runs
        if r.ok and not r.is_noise
    }
    peaks = peaks_for(wanted)
    (sweep_dir / PEAK_FILE).write_text(json.dumps(peaks, indent=2) + "\n")
    return peaks


def finish_sweep(sweep_dir: Path, run_one: RunOne) -> list[str]:
    """After every sweep point ran: its later timing rounds, the noise floor, the peak; write and
    print the comparison; returns one line per row whose proof failed."""
    run_rounds(load_runs([sweep_dir]), sweep_dir, run_one)
    run_noise_floor(load_runs([sweep_dir]), sweep_dir, run_one)
    runs = load_runs([sweep_dir])
    if runs:
        print(write_report(runs, sweep_dir, measure_peaks(runs, sweep_dir)))
        print(f"report: {sweep_dir}/comparison.md (.csv .json .png, comparison_parity.png)")
    return [
        f"{r.metrics.strategy} ({r.run_dir}): {r.parity}"
        for r in runs
        # "differs by design" (plain BatchNorm over fewer samples) is a measured outcome, not a failed proof
        if r.ok and r.parity not in ("pass", "envelope", "no baseline") and not r.parity.startswith(DIFFERS)
    ]
