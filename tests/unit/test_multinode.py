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
