"""Shared fixtures: run the real CLI in a subprocess with a timeout, read what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel_lab.cli.run import load_metrics
from parallel_lab.cli.run import run_cli as _run_cli

ROOT = Path(__file__).resolve().parent.parent


def run_cli(run_dir: Path, *overrides: str, in_process: bool = True, **kwargs):
    """parallel_lab.cli.run.run_cli from the checkout's root. The parent runs in this pytest
    process by default (the real main(), real worker processes; ~3 s of interpreter start-up saved
    per run); tests of how the command itself behaves as a process pass in_process=False."""
    return _run_cli(run_dir, *overrides, cwd=ROOT, in_process=in_process, **kwargs)


def assert_losses_close(losses, reference, rtol: float) -> None:
    assert len(losses) == len(reference)
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b} (rtol {rtol})"


def write_config(path: Path, *overrides: str) -> str:
    """The resolved config.yaml the CLI parent would write, for in-process training bodies; the run
    folder (where rank 0 leaves final_params.pt) is the path without its suffix."""
    from omegaconf import OmegaConf

    from parallel_lab.config import compose_config, validate

    cfg = validate(compose_config(["trainer.progress=false", *overrides]), Path(path).with_suffix(""))
    OmegaConf.save(cfg, path, resolve=True)
    return str(path)


@pytest.fixture
def cli(tmp_path):
    """cli(*overrides) runs one training run in a fresh folder and returns its metrics (plus run_dir)."""
    counter = iter(range(1000))

    def run(*overrides: str, **kwargs) -> dict:
        run_dir = tmp_path / f"run{next(counter)}"
        run_cli(run_dir, *overrides, **kwargs)
        return {**load_metrics(run_dir), "run_dir": str(run_dir)}

    return run


def assert_plan_matches(metrics: dict, tolerance: float = 0.01) -> None:
    """Every rank's model-state bytes (params + master + grads + optimizer) are within tolerance
    of the planner's prediction the worker stored beside them (``predicted_*``, parallel_lab.plan)."""
    from parallel_lab.plan.verify import rank_errors, stored_predictions

    for row in rank_errors(metrics, stored_predictions(metrics)):
        assert row["predicted"], f"{metrics['strategy']} rank {row['rank']}: no predicted_* in metrics.json"
        assert abs(row["error"]) <= tolerance, (metrics["strategy"], row)
