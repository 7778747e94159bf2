"""The MPI side, for real: mpiexec (MPICH from pip) on mpi_examples/*, the mpi4py <-> torch.distributed
mirror, the training run under mpirun, and the collectives bench as a correctness smoke run.

Every process tree is started in its own session and killed as a group on timeout, so a hang
fails the test instead of leaving spinning ranks behind.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parallel_lab.cli.run import load_metrics
from tests.support.checks import assert_losses_close
from tests.support.cli import ROOT

pytest.importorskip("mpi4py", reason="mpi4py is not installed; `make test` installs it (pip install mpi4py mpich)")
_local = Path(sys.executable).parent / "mpiexec"
MPIEXEC = str(_local) if _local.exists() else shutil.which("mpiexec")
if MPIEXEC is None:
    pytest.skip(
        "no mpiexec on PATH or next to python; `make test` installs it (pip install mpich)", allow_module_level=True
    )
IS_MPICH = "HYDRA" in subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=30).stdout
EXAMPLES = ROOT / "mpi_examples"
RAISE_ON_RANK1 = str(ROOT / "tests" / "support" / "mpi_raise_on_rank1.py")
TIMEOUT = 180  # seconds per job: generous for 2 shared cores, still ends a hang


class Hung(AssertionError):
    pass


def run(cmd: list[str], timeout: float = TIMEOUT, **extra_env: str) -> subprocess.CompletedProcess:
    """Run cmd in its own session; on timeout SIGKILL the whole group (mpiexec and every rank)."""
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning", **extra_env
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise Hung(f"{' '.join(cmd)} still running after {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpi(np_: int, *args: str, timeout: float = TIMEOUT, exitcodes: bool = False) -> subprocess.CompletedProcess:
    """``mpiexec -n np_ python <args>``; np_=0 means plain ``python <args>`` (an MPI singleton)."""
    if np_ == 0:
        return run([sys.executable, *args], timeout)
    flags = ["-print-all-exitcodes"] if exitcodes and IS_MPICH else []
    return run([MPIEXEC, *flags, "-n", str(np_), sys.executable, *args], timeout)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def example(name: str) -> str:
    return str(EXAMPLES / f"{name}.py")


# ---- pi_reduce ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [0, 2, pytest.param(3, marks=pytest.mark.extra)])
def test_pi_reduce_integral_error_below_1e_6(ranks):
    n = 10**6
    out = ok(mpi(ranks, example("pi_reduce"), str(n)))
    values = {m[1]: float(m[2]) for m in re.finditer(r"^(series|integral)\b.*pi ~ ([-\d.]+)", out, re.M)}
    assert set(values) == {"series", "integral"}, out
    assert abs(values["integral"] - math.pi) < 1e-6, out
    # The alternating series' error is bounded by its first omitted term: 4 / (2n + 1).
    assert abs(values["series"] - math.pi) <= 4 / (2 * n + 1) + 1e-12, out
    assert f"ranks={ranks or 1}" in out


# ---- send_recv, collectives, ring ----------------------------------------------------------------
@pytest.mark.parametrize("ranks", [0, 2, pytest.param(3, marks=pytest.mark.extra)])
def test_send_recv(ranks):
    out = ok(mpi(ranks, example("send_recv"), "65536"))
    if ranks:
        assert "tags received out of order, Isend/Irecv ring: ok" in out
        assert re.search(r"buffer API .* ms .*\n.*pickle API .* ms", out), out
    else:
        assert "Isend/Irecv to itself got 0" in out


def parse_collectives(out: str) -> dict[str, dict[int, list[float]]]:
    held = {}
    for line in out.splitlines():
        name, _, cells = line.partition("  ")
        found = re.findall(r"r(\d+)=\[([^\]]*)\]", cells)
        if found:
            held[name.strip()] = {int(r): [float(v) for v in vals.split(",")] for r, vals in found}
    return held


@pytest.mark.parametrize("ranks", [0, 2, 3, pytest.param(4, marks=pytest.mark.extra)])
def test_collectives_match_numpy(ranks):
    size, k = ranks or 1, 2
    out = ok(mpi(ranks, example("collectives"), str(size * k)))
    held = parse_collectives(out)
    x = np.arange(1, size * k + 1, dtype=float).reshape(size, k)  # rank r's input is row r
    assert held["Bcast"] == {r: list(x[0]) for r in range(size)}
    assert held["Scatter"] == {r: list(x[r]) for r in range(size)}
    assert held["Gather"] == {0: list(x.ravel())}
    assert held["Allgather"] == {r: list(x.ravel()) for r in range(size)}
    for op, f in (("SUM", np.sum), ("PROD", np.prod), ("MAX", np.max), ("MIN", np.min)):
        assert held[f"Reduce {op}"] == {0: list(f(x, axis=0))}
    assert held["Allreduce SUM"] == {r: list(x.sum(0)) for r in range(size)}
    assert held["Reduce_scatter SUM"] == {r: list(x[r] * size * (size + 1) / 2) for r in range(size)}
    sent = [100 * r + np.arange(size * k, dtype=float).reshape(size, k) for r in range(size)]
    assert held["Alltoall"] == {r: list(np.concatenate([sent[s][r] for s in range(size)])) for r in range(size)}
    assert "every result matches its closed form" in out


@pytest.mark.parametrize("ranks,n", [(0, 7), (2, 100_001), (3, 100_001), (3, 2)])
def test_ring_allreduce_equals_allreduce(ranks, n):
    out = ok(mpi(ranks, example("ring_allreduce"), str(n)))
    assert "ring result == Allreduce result, bit for bit" in out
    err = float(re.search(r"max \|ring - Allreduce\| = (\S+)", out)[1])
    assert err <= 1e-12 * max(1, ranks)


# ---- failures: bad input and exceptions ----------------------------------------------------------
BAD_INPUT = [
    ("pi_reduce", ["abc"], 2, "n='abc' is not an integer"),
    ("pi_reduce", ["0"], 2, "n=0 must be >= 1"),
    ("pi_reduce", ["-5"], 3, "n=-5 must be >= 1"),
    ("send_recv", ["1.5"], 2, "n='1.5' is not an integer"),
    ("ring_allreduce", ["-1"], 2, "n=-1 must be >= 1"),
    ("collectives", ["5"], 2, "total=5 elements cannot be Scattered evenly over 2 ranks"),
    ("collectives", ["8"], 3, "total=8 elements cannot be Scattered evenly over 3 ranks"),
    ("collectives", ["zero"], 2, "total='zero' is not an integer"),
]


@pytest.mark.parametrize("name,args,ranks,message", BAD_INPUT, ids=[f"{b[0]}-{b[1][0]}-n{b[2]}" for b in BAD_INPUT])
def test_bad_input_one_line_from_rank0_and_every_rank_exits_nonzero(name, args, ranks, message):
    result = mpi(ranks, example(name), *args, timeout=60, exitcodes=True)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr  # one line, from rank 0 only
    assert "Traceback" not in result.stderr
    if IS_MPICH:  # "[mpiexec@host] Exit codes: [host] 512,512" (wait statuses: exit 2 << 8)
        codes = re.search(r"Exit codes: \[[^\]]*\] ([\d,]+)", result.stdout + result.stderr)
        assert codes, result.stdout + result.stderr
        statuses = [int(c) for c in codes[1].split(",")]
        assert len(statuses) == ranks and all(s != 0 for s in statuses), statuses


@pytest.fixture
def aborted_mpich_segments():
    """MPICH unlinks its shared-memory segment (/dev/shm/mpich_shm_*) in MPI_Finalize; a job that is
    aborted or killed never gets there and leaves one 2 MiB file per job. The job's processes are
    gone when the test ends, so the files it made are removed here (measured: 3 per run of this
    module before this fixture)."""
    shm = Path("/dev/shm")
    before = set(shm.glob("mpich_shm_*"))
    yield
    for leftover in set(shm.glob("mpich_shm_*")) - before:
        leftover.unlink(missing_ok=True)


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.extra)])  # one bystander at 2, two at 3
@pytest.mark.usefixtures("aborted_mpich_segments")
def test_exception_on_one_rank_aborts_the_whole_job(ranks):
    start = time.monotonic()
    result = mpi(ranks, RAISE_ON_RANK1, timeout=60)
    assert result.returncode != 0
    assert "RuntimeError: boom on rank 1" in result.stderr
    assert time.monotonic() - start < 45, "the abort took too long"


@pytest.mark.extra  # a control that waits out its 5 s: make test runs the test above, with the hook
@pytest.mark.usefixtures("aborted_mpich_segments")
def test_without_the_hook_the_same_job_hangs():
    """The control: proves the test above is about the hook, not about mpiexec cleaning up."""
    with pytest.raises(Hung):
        mpi(2, RAISE_ON_RANK1, "--no-hook", timeout=5)


# ---- mirror: mpi4py == torch.distributed -------------------------------------------------------
def mirror_expected(size: int, k: int) -> dict[str, list[float] | None]:
    """Rank 0's result of every collective, computed with numpy from the mirror's inputs."""
    x = [np.arange(r * k + 1, (r + 1) * k + 1, dtype=float) for r in range(size)]
    full = [100.0 * r + np.arange(1, size * k + 1) for r in range(size)]
    exp = {
        "broadcast": x[0],
        "scatter": full[0][:k],
        "gather": np.concatenate(x),
        "all-gather": np.concatenate(x),
        "reduce-scatter": np.sum(full, axis=0)[:k],
        "all-to-all": np.concatenate([f[:k] for f in full]),
        "barrier": np.zeros(0),
    }
    for op, f in (("SUM", np.sum), ("PROD", np.prod), ("MAX", np.max), ("MIN", np.min)):
        exp[f"reduce {op}"] = exp[f"all-reduce {op}"] = f(x, axis=0)
    if size > 1:
        exp["send/recv"] = x[1]
        exp["isend/irecv"] = exp["sendrecv (ring step)"] = x[size - 1]
    return {name: list(v) for name, v in exp.items()}


# 3 ranks in make test-all: make test runs every mpi4py collective at 3 (test_collectives_match_numpy)
# and torch's at 3 (test_collectives.py); the mirror's claim, MPI equals torch, holds at 1 and 2 here.
@pytest.mark.parametrize("ranks", [0, 2, pytest.param(3, marks=pytest.mark.extra)])
def test_mirror_mpi_equals_torch_distributed(ranks, tmp_path):
    size, k = ranks or 1, 3
    out = ok(mpi(ranks, str(EXAMPLES / "mirror.py"), "--k", str(k), "--json", str(tmp_path / "m.json")))
    assert "every MPI result equals its torch.distributed twin" in out
    report = json.loads((tmp_path / "m.json").read_text())
    assert report["world_size"] == size
    # torch's rank/world came from the MPI launcher's variables, read by parallel_lab.comm.dist_env.
    assert report["source"] == ("none" if ranks == 0 else "PMI_RANK" if IS_MPICH else report["source"])
    expected = mirror_expected(size, k)
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) >= set(expected)
    for name, want in expected.items():
        assert rows[name]["equal"] is True, rows[name]
        assert rows[name]["mpi"] == want and rows[name]["torch"] == want, (name, rows[name], want)
    skipped = [r for r in report["rows"] if r["equal"] is None]
    assert all(size == 1 and "needs >= 2 ranks" in r["note"] for r in skipped)


def test_mirror_bad_argument():
    result = mpi(2, str(EXAMPLES / "mirror.py"), "--k", "0", timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--k: 0 must be >= 1" in errors[0], result.stderr


# ---- the training run under mpirun --------------------------------------------------------------
SMALL = ("strategy=ddp", "trainer.steps=3", "trainer.global_batch=32", "model=cnn")


@pytest.mark.slow
@pytest.mark.extra  # make test: the mpirun launcher's run equals raw mpiexec's (run_mpi.sh, below)
def test_cli_launcher_mpirun_matches_spawn(cli):
    spawn = cli(*SMALL, "launcher=spawn")
    mpirun = cli(*SMALL, "launcher=mpirun")
    assert (mpirun["launcher"], mpirun["world_size"]) == ("mpirun", 2)
    assert_losses_close(mpirun["losses"], spawn["losses"], rtol=1e-6)
    assert mpirun["final_param_checksum"] == pytest.approx(spawn["final_param_checksum"], rel=1e-6)


# ONE run_mpi.sh job serves the two tests below: its launcher=mpirun run and its raw mpiexec run
# train manual_ddp with MPI as the gradient transport (five fresh interpreters: the CLI parent, two
# ranks each way). Before, run_mpi.sh trained ddp and a second, in-process mpirun run trained
# manual_ddp over MPI: two more fresh ranks (~10 s of CPU) for a claim the script's run makes too.
MPI_TRANSPORT = ("strategy.allreduce=mpi",)


@pytest.fixture(scope="module")
def run_mpi_sh(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """launch/run_mpi.sh as a user types it, on manual_ddp over MPI: (its result, the run folder)."""
    from tests.support.model_parallel import BATCH, DATA_SIZE, STEPS  # as test_meshes: one cached reference

    env_root = tmp_path_factory.mktemp("run_mpi_sh") / "runs"
    overrides = (*MPI_TRANSPORT, f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}", f"data.size={DATA_SIZE}")
    cmd = ["bash", str(ROOT / "launch" / "run_mpi.sh"), "manual_ddp", *overrides, "trainer.progress=false"]
    return run(cmd, timeout=400, PYTHON=sys.executable, RUN_ROOT=str(env_root)), env_root / "manual_ddp"


@pytest.mark.slow
def test_run_mpi_sh_launcher_and_raw_mpiexec_agree(run_mpi_sh):
    from tests.support.model_parallel import STEPS

    result, run_dir = run_mpi_sh
    assert result.returncode == 0, result.stdout + result.stderr
    by_launcher = json.loads((run_dir / "metrics.launcher.json").read_text())
    raw = load_metrics(run_dir)  # rewritten by the raw `mpiexec -n 2 python -m parallel_lab.worker`
    assert len(raw["losses"]) == STEPS and raw["world_size"] == 2
    assert raw["losses"] == by_launcher["losses"]
    assert "identical losses" in result.stdout


# ---- MPI as the training transport: manual_ddp strategy.allreduce=mpi -------------------------------


@pytest.mark.floats  # a parity verdict
@pytest.mark.slow
def test_manual_ddp_over_mpi_trains_like_the_reference_and_reports_its_row(run_mpi_sh, tmp_path):
    """The gradient buckets averaged by MPI's Allreduce on zero-copy numpy views, under mpiexec (the
    raw form of run_mpi.sh's job; its launcher=mpirun form logged the same losses): the same training
    as the independent reference (judged against its noise floor), its bytes counted (2Ψ per step:
    MPI bypasses torch.distributed, so only manual_ddp's own record can count them), and a report
    row that tells it from the other all-reduce algorithms."""
    from parallel_lab.report.table import add_parity, load_runs, markdown
    from tests.support.model_parallel import cnn_reference

    result, run_dir = run_mpi_sh
    assert result.returncode == 0, result.stdout + result.stderr
    m = {**load_metrics(run_dir), "run_dir": str(run_dir)}
    by_launcher = json.loads((run_dir / "metrics.launcher.json").read_text())
    assert (by_launcher["launcher"], by_launcher["world_size"]) == ("mpirun", 2)
    assert (m["launcher"], m["world_size"], m["strategy_options"]["allreduce"]) == ("mpirun", 2, "mpi")
    assert "MPICH" in m["strategy_extras"]["mpi_library"] or not IS_MPICH, m["strategy_extras"]
    cnn_reference().assert_run_matches(m, "manual_ddp allreduce=mpi")
    for rank in m["ranks"]:  # one all-reduce of every gradient byte per step, in the ZeRO paper's 2x
        assert rank["comm_bytes_by_op"] == {"all_reduce": 2 * 4 * m["params"]}, rank["comm_bytes_by_op"]
    assert (m["nodes"], m["nproc_per_node"], m["inter_host_bytes_per_step"]) == (1, 2, 0.0)
    # The same record as a ring row beside it: the report must tell the two rows apart.
    twin = tmp_path / "ring_twin"
    twin.mkdir()
    record = json.loads((Path(m["run_dir"]) / "metrics.json").read_text())
    record["strategy_options"]["allreduce"] = "ring"
    (twin / "metrics.json").write_text(json.dumps(record))
    runs = load_runs([Path(m["run_dir"]), twin])
    add_parity(runs)
    rows = [line for line in markdown(runs).splitlines() if line.startswith("| manual_ddp")]
    # ring is strategy.allreduce's default: its row is labelled by the strategy alone
    assert sorted(row.split(" | ")[0] for row in rows) == ["| manual_ddp", "| manual_ddp allreduce=mpi"]
    assert all("| mpirun | 2 (1×2) |" in row for row in rows), rows


# ---- the bench, as a correctness smoke run (it checks every implementation's result) -----------
@pytest.mark.extra  # make test: the same implementations against torch.distributed (test_collectives.py)
def test_collectives_bench_smoke():
    result = run(
        [
            sys.executable,
            "-m",
            "parallel_lab.bench",
            "collectives",
            "--np",
            "3",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "4K",
            "--min-iters",
            "1",
            "--max-iters",
            "2",
            "--warmup",
            "0",
            "--rounds",
            "1",
        ]
    )
    out = ok(result)
    rows = [
        line for line in out.splitlines() if re.match(r"\| (all_reduce|all_gather|reduce_scatter|broadcast) \|", line)
    ]
    # Two tables, four ops at two sizes each: the timings (11 columns), then the hand/others ratios (6).
    widths = sorted(line.count("|") - 1 for line in rows)
    assert widths == [6] * 8 + [11] * 8, out
    assert "memcpy ceiling" in out and "hand/gloo busbw" in out
    assert "its ring's transport: shm" in out, out  # one host: the hand ring timed over shared memory
