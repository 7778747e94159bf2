"""Runs across several hosts, in-process: hosts the parent cannot reach get the exact per-host
commands printed, and nothing starts. The runs across simulated hosts and a private Slurm:
tests/integration/test_multinode.py."""

from __future__ import annotations

import shlex
from pathlib import Path

from tests.support.cli import run_cli


def test_hosts_out_of_reach_get_the_exact_per_host_commands(tmp_path):
    """launcher.remote_shell=null: nothing starts; each host's torchrun line is printed instead
    (the same lines the parent runs through ssh in tests/integration/test_multinode.py)."""
    run_dir = tmp_path / "run"
    overrides = ("launcher=torchrun", "launcher.hosts=[node0,node1]", "launcher.nproc_per_node=2", "world_size=4")
    result = run_cli(run_dir, *overrides, "launcher.remote_shell=null", "launcher.master_port=29555", check=False)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("[node")]
    assert [line.split()[0] for line in lines] == ["[node0]", "[node1]"], result.stdout
    for rank, line in enumerate(lines):
        argv = shlex.split(line.split(" ", 1)[1])
        assert argv[:2] == ["cd", str(Path.cwd())] and "OMP_NUM_THREADS=1" in argv
        assert {"--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=2", "--master_addr=node0"} <= set(argv)
        assert "--master_port=29555" in argv and argv[-1] == str(run_dir / "config.yaml")
    assert not (run_dir / "pids").exists() and not (run_dir / "metrics.json").exists()


def test_elastic_hosts_get_torchrun_elastic_commands(tmp_path):
    """launcher.min_nodes=1: --nnodes=1:2 with the c10d rendezvous on host 0, no fixed node rank,
    restarts allowed (the run on simulated hosts: tests/integration/test_elastic.py)."""
    run_dir = tmp_path / "run"
    overrides = ("launcher=torchrun", "launcher.hosts=[node0,node1]", "world_size=2", "launcher.min_nodes=1")
    more = ("trainer.checkpoint_every=5", "launcher.remote_shell=null", "launcher.master_port=29556")
    result = run_cli(run_dir, *overrides, *more, check=False)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("[node")]
    for line in lines:
        argv = set(shlex.split(line.split(" ", 1)[1]))
        assert {"--nnodes=1:2", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29556", "--max_restarts=3"} <= argv
        assert not any(a.startswith("--node_rank") for a in argv), line


def test_world_size_history_marks_the_change_in_the_report():
    from parallel_lab.report.table import _world_changes
    from parallel_lab.worker.record import closed_ranges
    from parallel_lab.worker.train import LoopState

    class Resumed:  # what Checkpointer.restore hands back, as far as the loop state reads it
        step, batches_consumed = 20, 20
        history = {"losses": [], "world_size_history": [{"from_step": 0, "world_size": 2, "strategy": "ddp"}]}

    state = LoopState.start(Resumed(), {"world_size": 1, "strategy": "ddp"})
    ranges = closed_ranges(state.history["world_size_history"], 60)
    assert [(r["from_step"], r["to_step"], r["world_size"]) for r in ranges] == [(0, 20, 2), (20, 60, 1)]

    class Metrics:
        world_size_history = ranges

    assert _world_changes(Metrics()) == " [2→1 at step 20]"
