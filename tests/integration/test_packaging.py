"""Installs: ``parallel-lab`` and ``python -m parallel_lab`` behave the same from any folder, in the
editable install (this environment) and in a non-editable install of a built wheel, which must carry
conf/ (setup.py maps it into the package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import ROOT

SOURCES = ("pyproject.toml", "setup.py", "README.md", "parallel_lab", "conf")


def run(cmd: list, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def assert_help_and_bad_input(command: list, cwd: Path, **env: str) -> str:
    """--help names the tool and how to start; strategy=nope is the one-line error, exit 2."""
    shown = run([*command, "--help"], cwd, **env)
    assert shown.returncode == 0, shown.stderr
    for text in ("parallel-lab", "make demo", "make test", "comparison.md", "strategy: ddp, dp, fsdp"):
        assert text in shown.stdout, text
    assert "powered by Hydra" not in shown.stdout
    bad = run([*command, "strategy=nope"], cwd, **env)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("parallel_lab: error: unknown strategy 'nope'")
    return shown.stdout


def test_console_script_and_module_agree_from_another_folder(tmp_path):
    script = Path(sys.executable).parent / "parallel-lab"
    if not script.exists():
        pytest.skip("parallel-lab console script not installed in this interpreter's bin (make installs it)")
    by_module = assert_help_and_bad_input([sys.executable, "-m", "parallel_lab"], tmp_path)
    assert assert_help_and_bad_input([script], tmp_path) == by_module


def test_wheel_carries_conf_and_runs_from_another_folder(tmp_path):
    src, site, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    src.mkdir()
    for name in SOURCES:  # a copy, so building leaves no build/ or egg-info in the checkout
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    built = run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, src], tmp_path
    )
    assert built.returncode == 0, built.stderr
    wheel = next(tmp_path.glob("parallel_lab-*.whl"))
    installed = run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel], tmp_path)
    assert installed.returncode == 0, installed.stderr
    assert (site / "parallel_lab" / "conf" / "strategy" / "ddp.yaml").is_file()
    # every data file the package reads beside its modules ships too (bench/published_runs.csv)
    package = ROOT / "parallel_lab"
    data = [p.relative_to(ROOT) for p in package.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    missing = [str(p) for p in data if not (site / p).is_file()]
    assert data and not missing, f"not in the wheel: {missing}"
    where = run(
        [sys.executable, "-c", "import parallel_lab.config as c; print(c.CONF_DIR)"], elsewhere, PYTHONPATH=str(site)
    )
    assert where.stdout.strip() == str(site / "parallel_lab" / "conf"), where.stderr
    assert_help_and_bad_input([sys.executable, "-m", "parallel_lab"], elsewhere, PYTHONPATH=str(site))
