"""The spine, run: parity of single/ddp against an independent reference, the same run under every
launcher, forked ranks only where a fork equals a fresh interpreter, and the report from real runs.
The registry and Hydra composition, in-process: tests/unit/test_spine.py."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parallel_lab.cli.run import load_metrics
from parallel_lab.comm.dist_env import free_port
from parallel_lab.config import compose_config, validate
from parallel_lab.models import build_meta_model
from parallel_lab.plan.configs import planned_configs
from parallel_lab.report.__main__ import main as report_main
from parallel_lab.strategies.ddp_rules import DDPPlan
from tests.support.checks import assert_plan_matches
from tests.support.cli import ROOT, run_cli
from tests.support.reference import parity_reference

CNN_SPINE = ("model=cnn", "trainer.steps=4", "trainer.global_batch=32")


@pytest.fixture(scope="module")
def cnn_spine(tmp_path_factory):
    """The cnn runs of `single` and of `ddp` (spawn), once per module: the parity test and the
    launcher test both compare with them."""
    runs = {}
    for strategy in ("single", "ddp"):
        run_dir = tmp_path_factory.mktemp(f"spine_{strategy}")
        run_cli(run_dir, f"strategy={strategy}", *CNN_SPINE)
        runs[strategy] = {**load_metrics(run_dir), "run_dir": str(run_dir)}
    return runs


def assert_spine_run(run: dict, ref) -> None:
    ref.assert_run_matches(run)
    assert_plan_matches(run)  # parallel_lab.plan's prediction, stored beside the measurement


@pytest.mark.parity
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_single_and_ddp_match_independent_reference(cnn_spine, strategy):
    run = cnn_spine[strategy]
    assert_spine_run(run, parity_reference("cnn", steps=4, global_batch=32))
    if strategy == "ddp":
        assert run["world_size"] == 2 and run["backend"] == "gloo" and len(run["ranks"]) == 2
        assert all(r["param_bytes"] == 4 * run["params"] for r in run["ranks"])
        # torch makes the first bucket bucket_cap_mb when the option is passed, not 1 MiB: the
        # cnn's 1.3 MB of gradients are one bucket, one all-reduce per step (DDPPlan.collective_calls)
        (planned,) = planned_configs(["strategy=ddp", *CNN_SPINE])
        predicted = DDPPlan.collective_calls(planned.cfg, build_meta_model(planned.cfg.model))["all_reduce"]
        assert run["strategy_extras"]["buckets"] == predicted == 1


@pytest.mark.parity
@pytest.mark.extra
def test_resnet18_ddp_matches_independent_reference(cli):
    """The larger model through the same command. make test-all (with single's and dp's, manual_ddp's
    parity on it); make test trains resnet18 under ZeRO (test_sharded.py's memory rows) and pp
    (test_profile.py), and judges parity on the cnn and the vit."""
    ddp = cli("strategy=ddp", "model=resnet18", "trainer.steps=2", "trainer.global_batch=8")
    assert_spine_run(ddp, parity_reference("resnet18", steps=2, global_batch=8))


@pytest.mark.parity
@pytest.mark.extra
def test_resnet18_single_matches_independent_reference(cli):
    single = cli("strategy=single", "model=resnet18", "trainer.steps=2", "trainer.global_batch=8")
    assert_spine_run(single, parity_reference("resnet18", steps=2, global_batch=8))


@pytest.mark.parity
@pytest.mark.extra  # make test: grad_accum=2 in test_data_parallel.py (manual_ddp matrix, ddp no_sync)
def test_grad_accum_keeps_the_same_losses(cli):
    ref = parity_reference(steps=3, global_batch=32)
    ref.assert_run_matches(cli("strategy=ddp", "trainer.steps=3", "trainer.global_batch=32", "trainer.grad_accum=2"))


@pytest.mark.parametrize(
    "launcher",
    # Both in make test-all. make test: torchrun's fresh interpreters train bit for bit as forked
    # ranks in test_checkpoint.py's kill-during-write run (restarted once; its ddp run against the
    # forked straight run, which the spawn command's resumed runs there equal too); launcher=mpirun's
    # run equals raw mpiexec's (test_mpi.py run_mpi.sh).
    [pytest.param("torchrun", marks=pytest.mark.extra), pytest.param("mpirun", marks=pytest.mark.extra)],
)
def test_same_ddp_run_under_spawn_and_another_launcher(cli, cnn_spine, launcher):
    if launcher == "mpirun" and not (Path(sys.executable).parent / "mpiexec").exists() and not shutil.which("mpiexec"):
        pytest.skip("mpiexec not installed (make installs it: pip install mpi4py mpich)")
    runs = {"spawn": cnn_spine["ddp"], launcher: cli("strategy=ddp", *CNN_SPINE, f"launcher={launcher}")}
    assert {r["launcher"] for r in runs.values()} == {"spawn", launcher}
    # spawn's ranks are forked from the warm zygote; the real tools start fresh interpreters: the
    # same weights to the last bit say a forked rank is as clean as a new process.
    started = {name: r["rank_start"] for name, r in runs.items()}
    assert started == {"spawn": "fork", launcher: "exec"}
    for name in (launcher,):
        assert runs[name]["losses"] == runs["spawn"]["losses"], name
        assert runs[name]["final_param_sha256"] == runs["spawn"]["final_param_sha256"], name


@contextlib.contextmanager
def _zygotes_of_this_test(monkeypatch):
    """Zygotes started inside are this test's own and preload nothing (a bare interpreter, ~0.1 s,
    not torch's import): the session's fork server is set aside, still running, and put back after,
    so the next run forks from it instead of starting a new one (about 6 s of CPU)."""
    from multiprocessing import forkserver

    from parallel_lab.worker import zygote

    server = forkserver._forkserver
    handles = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds")
    saved, saved_state = {name: getattr(server, name) for name in handles}, (zygote._zygote.pid, zygote._zygote.env)
    monkeypatch.setattr(zygote, "PRELOAD", [])
    for name in handles:
        setattr(server, name, None)
    try:
        yield
    finally:
        server._stop()  # this test's zygote, if one runs
        for name, value in saved.items():
            setattr(server, name, value)
        zygote._zygote.pid, zygote._zygote.env = saved_state


def test_spawn_forks_ranks_only_where_a_fork_equals_a_fresh_interpreter(monkeypatch):
    """launcher.fork_ranks=false or another launcher: fresh interpreters. An environment that torch
    reads at import (ATEN_CPU_CAPABILITY picks the kernels) changed since the zygote started: a new
    zygote under the new environment."""
    from parallel_lab.cli.launch import _fork_spawned_ranks, launcher_commands
    from parallel_lab.worker import zygote

    def forks(*overrides: str) -> bool:
        cfg = validate(compose_config(["world_size=2", *overrides]))
        return _fork_spawned_ranks(cfg, launcher_commands(cfg, Path("config.yaml"), 29500))

    assert not forks("launcher.fork_ranks=false")
    assert not forks("launcher=torchrun")
    with _zygotes_of_this_test(monkeypatch):
        assert forks()
        old_zygote = zygote._zygote.pid
        other_kernels = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", other_kernels)
        assert forks() and zygote._zygote.pid != old_zygote
        assert zygote._zygote.env["ATEN_CPU_CAPABILITY"] == os.environ["ATEN_CPU_CAPABILITY"]


@pytest.mark.extra  # make test runs the worker under real torchrun: test_checkpoint.py kill-during-write
def test_worker_runs_under_raw_torchrun_on_a_written_config(tmp_path):
    run_dir = tmp_path / "run"
    run_cli(run_dir, "strategy=ddp", "trainer.steps=2", "trainer.global_batch=16")
    first = load_metrics(run_dir)
    (run_dir / "metrics.json").unlink()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "parallel_lab.worker",
        str(run_dir / "config.yaml"),
    ]
    result = subprocess.run(cmd, cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert load_metrics(run_dir)["losses"] == first["losses"]


def test_report_renders_table_from_runs_and_one_step_shows_all_model_state(tmp_path, capsys):
    # One step: Adam creates its state in that step, and the report must still show 8 bytes/param.
    run_cli(tmp_path / "a", "strategy=single", "trainer.steps=1", "trainer.global_batch=16")
    run_cli(tmp_path / "b", "strategy=ddp", "trainer.steps=1", "trainer.global_batch=16")
    # python -m parallel_lab.report's main(), here (tests/integration/test_plugins.py starts it as a process).
    assert report_main([str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "strategy" not in line]
    # A single and a ddp run, no noise-floor reruns: no verdict, and the report says how to get one.
    assert len(rows) == 2 and all("no noise floor" in row for row in rows), stdout
    assert "reruns the baseline for the noise floor" in stdout
    for name in ("comparison.md", "comparison.csv", "comparison.json"):
        assert (tmp_path / name).is_file()
    with open(tmp_path / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for kind in ("params", "grads", "optim"):
            measured, analytic = float(row[f"{kind} MiB measured"]), float(row[f"{kind} MiB analytic"])
            assert analytic > 0 and abs(measured - analytic) <= 1e-4 * analytic, (row["strategy"], kind)
    assert_md_shows_what_a_reader_compares(tmp_path, rows)


def significant_digits(number: str) -> int:
    """How many significant digits a number in the md table shows ('0.002321' and '2.384e-07': 4)."""
    mantissa = number.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
    return len(mantissa)


def assert_md_shows_what_a_reader_compares(run_dirs: Path, csv_rows: list[dict]) -> None:
    """comparison.md: at most 16 columns, CUDA memory only when a GPU ran, every measured number to
    4 significant digits (1000 and above: whole, grouped); comparison.csv: every column, unrounded."""
    from parallel_lab.protocol import FailedRun
    from parallel_lab.report.table import add_parity, load_runs, markdown

    lines = (run_dirs / "comparison.md").read_text().splitlines()
    header, rows = lines[0].strip("| ").split(" | "), [line for line in lines[2:] if line.startswith("| ")]
    assert len(header) <= 16 and not any("CUDA" in h for h in header), header
    assert len(csv_rows[0]) > len(header) and "CUDA alloc MiB" in csv_rows[0] and "final loss" in csv_rows[0]
    for line, raw in zip(rows, csv_rows):
        cells = dict(zip(header, line.strip("| ").split(" | ")))
        for column in ("samples/s", "step ms", "peak RSS MiB", "model state MiB meas/plan/paper"):
            for number in re.findall(r"[-\d.,e+]+", cells[column]):  # a median's interval: "30.99 (30.51–31.60)"
                assert significant_digits(number) == 4 or "," in number, (column, cells[column])
        samples = float(raw["samples/s"])  # the csv keeps the measured value whole
        median = cells["samples/s"].split(" (")[0]  # the md cell: median (interval)
        assert samples != round(samples, 2) and abs(float(median.replace(",", "")) - samples) < 1
    # The same ddp run as a GPU on two hosts with a mesh records it, and a failed run: the columns
    # those call for appear, and the widest table is still 16.
    twin = run_dirs / "gpu_twin"
    twin.mkdir()
    record = json.loads((run_dirs / "b" / "metrics.json").read_text())
    for rank in record["ranks"]:
        rank.update(cuda_max_allocated_bytes=3 * 2**20, cuda_max_reserved_bytes=4 * 2**20)
    mesh = {"dims": {"replicate": 2, "shard": 1}, "comm_bytes_per_step": {"replicate": 2**20, "shard": 0}}
    record.update(nodes=2, nproc_per_node=1, inter_host_bytes_per_step=2**20, strategy_extras={"mesh": mesh})
    for rank in record["ranks"]:  # and as profiled (trainer.profile): the exposed-communication column
        rank["time_ms"] = dict(step=10.0, compute=6.0, comm=4.0, exposed_comm=1.0, optimizer=1.0, idle=0.0, other=2.0)
    (twin / "metrics.json").write_text(json.dumps(record))
    (run_dirs / "failed").mkdir()
    failed = FailedRun(strategy="ddp", launcher="spawn", world_size=3, model="cnn", error="bad batch")
    failed.write(run_dirs / "failed" / "failed.json")
    runs = load_runs([run_dirs / "a", twin, run_dirs / "failed"])
    add_parity(runs)
    text = markdown(runs)
    header = text.splitlines()[0]
    assert len(header.strip("| ").split(" | ")) == 16, header
    shown_cells = ("| CUDA alloc/reserved MiB |", "| 3.000 / 4.000 |", "(2×1) | replicate 2 (1.000) × shard 1 (0) |")
    for shown in (*shown_cells, "| 1.000 / 4.000 (75.00%) |"):
        assert shown in text, (shown, text)
    assert "| failed | bad batch |" in text, text
