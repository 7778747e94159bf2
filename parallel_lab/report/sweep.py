"""The end of a sweep (a Hydra callback): rerun the baseline for the noise floor, then write and
print the comparison. A row whose parity is not proven makes the command exit non-zero."""

from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback

from parallel_lab.protocol import CONFIG_FILE
from parallel_lab.report.parity import noise_reruns
from parallel_lab.report.table import DIFFERS, Row, baseline_key, is_baseline, load_runs, write_report

NOISE_DIR = "noise_floor"
failed_proofs: list[str] = []  # rows of this process's sweeps whose proof failed; sets the exit code


def run_noise_floor(runs: list[Row], sweep_dir: Path) -> None:
    """Rerun every baseline of the sweep once per noise_reruns() perturbation (the same training in
    other last bits, report/parity.py), through the same launcher as any run. One baseline per
    baseline_key, which includes the precision: a bf16 `single` gets its own reruns (bf16 rows'
    envelope), beside the fp32 one's."""
    from omegaconf import OmegaConf

    from parallel_lab.cli.main import run_one

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


class SweepReport(Callback):
    """Hydra callback: at the end of every --multirun sweep, measure the noise floor, then write
    and print the comparison."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        run_noise_floor(load_runs([sweep_dir]), sweep_dir)
        runs = load_runs([sweep_dir])
        if runs:
            print(write_report(runs, sweep_dir))
            print(f"report: {sweep_dir}/comparison.md (.csv .json .png, comparison_parity.png)")
        failed_proofs.extend(
            f"{r.metrics.strategy} ({r.run_dir}): {r.parity}"
            for r in runs
            # "differs by design" (plain BatchNorm over fewer samples) is a measured outcome, not a failed proof
            if r.ok and r.parity not in ("pass", "envelope", "no baseline") and not r.parity.startswith(DIFFERS)
        )
