"""The end of a sweep: rerun the baseline for the noise floor, then write and print the comparison,
and hand back the rows whose parity is not proven (the command exits non-zero for them)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from parallel_lab.protocol import CONFIG_FILE
from parallel_lab.report.parity import noise_reruns
from parallel_lab.report.table import DIFFERS, Row, baseline_key, is_baseline, load_runs
from parallel_lab.report.write import write_report

NOISE_DIR = "noise_floor"
RunOne = Callable[[DictConfig, Path], int]  # one run from its config (cli/main.py's run_one)


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
            cfg = OmegaConf.load(Path(base.run_dir) / CONFIG_FILE)
            cfg.trainer.update(changes, noise_rerun=label)
            cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_dir = 0, None
            run_one(cfg, sweep_dir / NOISE_DIR / f"{Path(base.run_dir).name}_{label.replace('=', '')}")


def finish_sweep(sweep_dir: Path, run_one: RunOne) -> list[str]:
    """After every sweep point ran: measure the noise floor, write and print the comparison; returns
    one line per row whose proof failed."""
    run_noise_floor(load_runs([sweep_dir]), sweep_dir, run_one)
    runs = load_runs([sweep_dir])
    if runs:
        print(write_report(runs, sweep_dir))
        print(f"report: {sweep_dir}/comparison.md (.csv .json .png, comparison_parity.png)")
    return [
        f"{r.metrics.strategy} ({r.run_dir}): {r.parity}"
        for r in runs
        # "differs by design" (plain BatchNorm over fewer samples) is a measured outcome, not a failed proof
        if r.ok and r.parity not in ("pass", "envelope", "no baseline") and not r.parity.startswith(DIFFERS)
    ]
