"""The command line from the tests: a run (its parent in this process by default), the config a
run would resolve, and the one-line error a refused run must end with."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.checkpoint import COMPLETE
from parallel_lab.cli.run import run_cli as _run_cli

ROOT = Path(__file__).resolve().parents[2]  # the checkout: conf/, launch/, mpi_examples/


def run_cli(run_dir: Path, *overrides: str, in_process: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """parallel_lab.cli.run.run_cli from the checkout's root. The parent runs in this pytest
    process by default (the real main(), real worker processes; ~3 s of interpreter start-up saved
    per run); tests of how the command itself behaves as a process pass in_process=False."""
    return _run_cli(run_dir, *overrides, cwd=ROOT, in_process=in_process, **kwargs)


def compose_cfg(*overrides: str) -> DictConfig:
    """conf/config.yaml + overrides, composed as the parent does (not yet validated)."""
    from parallel_lab.config import compose_config

    return compose_config(overrides)


def write_config(path: Path, *overrides: str) -> str:
    """The resolved config.yaml the CLI parent would write, for in-process training bodies; the run
    folder (where rank 0 leaves final_params.pt) is the path without its suffix."""
    from omegaconf import OmegaConf

    from parallel_lab.config import compose_config, validate

    cfg = validate(compose_config(["trainer.progress=false", *overrides]), Path(path).with_suffix(""))
    OmegaConf.save(cfg, path, resolve=True)
    return str(path)


def assert_one_clean_line(result: subprocess.CompletedProcess, run_dir: Path, named: str | tuple[str, ...]) -> str:
    """A refused run: non-zero exit, exactly one ``parallel_lab: error: <what>; <fix>`` line (the last
    one) naming every text in named, no traceback, and a run folder (if any) that does not claim
    success. Returns the line."""
    assert result.returncode != 0, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "parallel_lab: error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    line = errors[0]
    assert line.startswith("parallel_lab: error:") and result.stderr.rstrip().endswith(line), result.stderr[-3000:]
    for text in (named,) if isinstance(named, str) else named:
        assert text in line, f"{text!r} not in {line!r}"
    assert "; " in line, f"no fix given after the problem: {line!r}"  # "<what is wrong>; <what to do>"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if run_dir.exists():  # refused before Hydra made a folder, or a folder that says it failed
        assert not (run_dir / "metrics.json").exists()
        assert json.loads((run_dir / "failed.json").read_text())["status"] == "failed"
        assert not list(run_dir.glob(f"checkpoints/*/{COMPLETE}"))
    return line
