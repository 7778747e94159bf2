"""One class and one yaml is all a new strategy needs: a throwaway strategy registered from a temp
folder (PARALLEL_LAB_PLUGINS) shows up in compare_all's sweep, the report and the checkpoint bench.
A strategy that does not say where its model state lives is refused when it registers:
tests/unit/test_plugins.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from parallel_lab.cli.run import run_ranks
from parallel_lab.plugins import PLUGINS_ENV
from tests.support.bodies.plugin import sweep_and_report
from tests.support.cli import ROOT

PLUGIN = '''
"""A throwaway strategy for the plugin test: one process, like single."""
from parallel_lab.strategies import register
from parallel_lab.strategies.base import Strategy
from parallel_lab.strategies.replicated import OneProcessPlan, ReplicatedMemory, ReplicatedState


@register("toy")
class ToyStrategy(Strategy):
    plan = OneProcessPlan
    State = ReplicatedState
    Memory = ReplicatedMemory
'''
YAML = """
defaults:
  - /strategy_options/toy@_here_
name: toy
"""


@pytest.fixture
def plugin_env(tmp_path) -> dict:
    (tmp_path / "toy_plugin.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "conf" / "strategy").mkdir(parents=True)
    (tmp_path / "conf" / "strategy" / "toy.yaml").write_text(textwrap.dedent(YAML))
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, PLUGINS_ENV: "toy_plugin", "PYTHONPATH": path}


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stderr}"
    return result


@pytest.mark.slow
def test_plugin_strategy_is_in_the_sweep_a_run_and_the_report(plugin_env, tmp_path):
    """The run is the command as a user types it (PYTHONPATH and PARALLEL_LAB_PLUGINS reach the
    parent, the zygote and the rank); the sweep listing and the report run their own main() in one
    rank forked from the zygote (tests/support/bodies/plugin.py), the plugin imported the same way."""
    run_dir = tmp_path / "run"
    run(
        plugin_env,
        "-m",
        "parallel_lab",
        "strategy=toy",
        "trainer.steps=2",
        "trainer.global_batch=16",
        "trainer.progress=false",
        f"hydra.run.dir={run_dir}",
    )
    (out,) = run_ranks(sweep_and_report, 1, env={PLUGINS_ENV: "toy_plugin"}, folder=str(tmp_path), run_dir=str(run_dir))
    shown = json.loads(out.splitlines()[-1])
    sweep = next(line for line in shown["sweep"].splitlines() if line.strip().startswith("strategy: single,"))
    assert "toy" in sweep.split(":", 1)[1].strip().split(",") and "zero0" in sweep
    assert any(line.startswith("| toy |") for line in shown["report"].splitlines()), shown["report"]


@pytest.mark.slow
@pytest.mark.extra  # make test: the plugin in the sweep, a run and the report (above); same registry
def test_plugin_strategy_is_in_the_checkpoint_bench(plugin_env):
    bench = run(plugin_env, "-m", "parallel_lab.bench", "checkpoint", "--model", "cnn", "--only", "toy")
    assert any(line.startswith("| toy |") for line in bench.stdout.splitlines()), bench.stdout
