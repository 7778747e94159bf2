"""Shared fixtures: run the real CLI in a subprocess with a timeout, read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI_TIMEOUT = 420  # seconds; generous for 2 shared cores, still ends a hung run


def run_cli(run_dir: Path, *overrides: str, timeout: float = CLI_TIMEOUT, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """``python -m parallel_lab hydra.run.dir=<run_dir> trainer.progress=false <overrides>``."""
    cmd = [sys.executable, "-m", "parallel_lab", f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def load_metrics(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


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
