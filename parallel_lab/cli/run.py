"""Helpers to run the real thing from tests and benchmarks.

- :func:`run_cli` / :func:`run_cli_metrics`: one ``python -m parallel_lab`` run, and what it
  measured (the one place tests and benchmarks start the command line). The parent runs in a new
  interpreter, or with ``in_process=True`` in this one (the same ``main()``, the workers still real
  processes): a parent interpreter costs ~3 s of CPU start-up (torch, Hydra, every strategy's
  schema), which is most of a short test run.
- :func:`run_ranks`: a distributed test body, a plain function ``fn(rank, world_size, **kwargs)``
  defined at the top level of an importable module, on N processes with a gloo group on 127.0.0.1
  (Accelerate-style), each forked from a fork server that imported torch once for the session (it
  ends with this process) and imports fn's module by name; the same function runs under any real
  launcher via ``python -m parallel_lab.cli.run module:function '{"kw": 1}'``. On failure every
  rank's stderr is shown, and every process is gone when it returns.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from parallel_lab.comm.dist_env import free_port, read_dist_env
from parallel_lab.protocol import METRICS_FILE, RunMetrics

CLI_TIMEOUT = 420  # seconds; generous for 2 shared cores, still ends a hung run


class CLIFailed(RuntimeError):
    """A ``python -m parallel_lab`` run that was expected to succeed exited non-zero."""


def run_cli(
    run_dir: Path,
    *overrides: str,
    timeout: float = CLI_TIMEOUT,
    env: dict | None = None,
    check: bool = True,
    cwd: Path | None = None,
    in_process: bool = False,
) -> subprocess.CompletedProcess:
    """``python -m parallel_lab hydra.run.dir=<run_dir> trainer.progress=false <overrides>``;
    Hydra's own flags (``--multirun``) at the start of overrides stay first, as argparse needs."""
    flags = list(itertools.takewhile(lambda arg: arg.startswith("-"), overrides))
    argv = [*flags, f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides[len(flags) :]]
    if in_process:
        result = _run_cli_in_this_process(argv, timeout, env or {})
    else:
        cmd = [sys.executable, "-m", "parallel_lab", *argv]
        result = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    if check and result.returncode != 0:
        raise CLIFailed(
            f"{' '.join(map(str, result.args))} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


class CLITimedOut(BaseException):
    """An in-process run passed its timeout. A BaseException so that Hydra's job runner does not
    report it as the job's own error; launch()'s ``finally`` stops every worker on the way out."""


def _on_alarm(signum, frame):
    raise CLITimedOut("timed out")


@contextlib.contextmanager
def _captured_fds():
    """Everything written to fd 1 and 2 (this process through sys.stdout/err, and every child
    process it starts) goes to two temporary files; yields a function that reads one of them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    files = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
    try:
        for fd, f in files.items():
            os.dup2(f.fileno(), fd)
        with (
            open(os.dup(1), "w", buffering=1) as out,
            open(os.dup(2), "w", buffering=1) as err,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            yield lambda fd: (out.flush(), err.flush(), files[fd].seek(0), files[fd].read().decode(errors="replace"))[
                -1
            ]
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        for f in files.values():
            f.close()


def _run_cli_in_this_process(argv: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    """The command line's main() with this argv, here; a timeout ends it (and its workers)."""
    from hydra.core.global_hydra import GlobalHydra

    from parallel_lab.cli import main as cli

    saved_argv, sys.argv = sys.argv, ["parallel_lab", *argv]
    saved_env = dict(os.environ)
    os.environ.update(env)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    code, outputs = 0, ("", "")
    try:
        with _captured_fds() as read:
            try:
                code = cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except CLITimedOut:
                code = -signal.SIGALRM
                print(f"[timed out after {timeout} s]", file=sys.stderr)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                outputs = (read(1), read(2))
    finally:
        signal.signal(signal.SIGALRM, previous)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess(["parallel_lab", *argv], code, *outputs)


def load_metrics(run_dir: Path) -> dict:
    """A run's metrics.json, read as the record it is (a missing or malformed field fails here)."""
    return RunMetrics.read(Path(run_dir) / METRICS_FILE).to_json()


def run_cli_metrics(run_dir: Path, *overrides: str, **kwargs) -> dict:
    """run_cli, then the metrics it wrote."""
    run_cli(run_dir, *overrides, **kwargs)
    return load_metrics(run_dir)


def _resolve(target: str):
    module, _, name = target.partition(":")
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


def target_of(fn: Callable) -> str:
    """``module:qualname``, the name a forked rank (or ``python -m parallel_lab.cli.run``) imports fn
    by; refused here for a function no other process could import by name."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not name or "<" in name:
        raise ValueError(
            f"run_ranks needs a function defined at the top level of an importable module, got {fn!r}: "
            "its ranks import it by name"
        )
    return f"{module}:{name}"


def _forked_rank(env: dict[str, str], out_path: str, err_path: str, target: str, kwargs_json: str) -> None:
    """One rank, in a process forked from the zygote: this rank's environment and output files,
    then the same main() as ``python -m parallel_lab.cli.run``."""
    for fd, path in ((1, out_path), (2, err_path)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch read OMP_NUM_THREADS in the zygote
    try:
        code = main([target, kwargs_json])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


FAILED_RANK_GRACE_S = 10  # after one rank fails, its peers usually fail within a second (gloo)


def _wait_for_ranks(procs: list, timeout: float) -> bool:
    """Wait for every rank; once one has failed give the rest FAILED_RANK_GRACE_S, then kill
    whatever still runs (also at the timeout). True if anything had to be killed."""
    deadline = time.monotonic() + timeout
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        if any(proc.exitcode not in (None, 0) for proc in procs):
            deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE_S)
        time.sleep(0.05)
    killed = [proc for proc in procs if proc.is_alive()]
    for proc in killed:
        proc.kill()
    for proc in procs:
        proc.join()
    return bool(killed)


def run_ranks(
    fn: Callable[..., None], world_size: int, timeout: float = 120, env: dict | None = None, **kwargs
) -> list[str]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks (kwargs travel as JSON);
    return each rank's stdout; raise with all ranks' stderr if any rank fails or the timeout passes
    (every rank is killed then)."""
    target = target_of(fn)
    port = free_port()
    from parallel_lab.worker import zygote  # imported torch once for the session: each rank forks from it

    with tempfile.TemporaryDirectory(prefix="parallel_lab_ranks_") as folder:
        procs, files = [], []
        for rank in range(world_size):
            rank_env = dict(os.environ, **(env or {}))
            rank_env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            files.append((f"{folder}/rank{rank}.out", f"{folder}/rank{rank}.err"))
            args = (rank_env, *files[-1], target, json.dumps(kwargs))
            procs.append(zygote.start_process(_forked_rank, args, name=f"{target} rank {rank}"))
        timed_out = _wait_for_ranks(procs, timeout)
        outputs = [
            (Path(out).read_text(), Path(err).read_text(), proc.exitcode) for proc, (out, err) in zip(procs, files)
        ]
    if timed_out or any(code != 0 for _, _, code in outputs):
        note = "\n[ranks still running were killed: timeout or a failed peer]" if timed_out else ""
        report = "\n".join(f"--- rank {r} (exit {c}) stderr ---\n{e}" for r, (_, e, c) in enumerate(outputs))
        raise AssertionError(f"{target} failed on {world_size} ranks:{note}\n{report}")
    return [out for out, _, _ in outputs]


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    # Everything imported by now (torch, its compiler, this package: the zygote's objects in a forked
    # rank) lives as long as the rank: frozen, each full collection (a body's gc.collect() between
    # runs, the collector's own) walks only what the function creates, as in a worker
    # (parallel_lab.worker.main.leave_imports_out_of_collections). gc.freeze() itself costs nothing.
    gc.freeze()
    target, kwargs = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    env = read_dist_env("cpu")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        _resolve(target)(env.rank, env.world_size, **kwargs)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # peers may be gone: skip gloo teardown, which could hang
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
