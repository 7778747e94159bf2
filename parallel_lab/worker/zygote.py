"""Ranks forked from a warm interpreter: the spawn launcher's CPU ranks start in ~0.1 s, not ~6 s.

A fresh ``python -m parallel_lab.worker`` spends about 6 s of CPU before its first step (measured
per worker on the 2-core CI machine): importing torch, ``torch._dynamo`` (torch.optim imports the
compiler at the first optimizer step) and this package. Every rank pays it, on the same cores.
The zygote is multiprocessing's fork server with those modules preloaded: it is started once per
parent process (so a whole sweep, ``make demo`` or a test session, shares it), and each rank is a
``fork()`` of it that runs the very same ``parallel_lab.worker.main.main()`` in its own session,
with its own environment and the launcher's current stdout/stderr. Nothing in ``PRELOAD`` starts a
thread or touches a device, so a forked rank is as clean as a new interpreter.

On CUDA the fork is skipped (a fresh interpreter per rank, as before): a process must not fork
after the CUDA driver may have been initialised, and torch's import probes the driver on a GPU
machine. When a variable read at interpreter start or at torch's import (``IMPORT_TIME_PREFIXES``,
e.g. ``ATEN_CPU_CAPABILITY``, which picks the CPU kernels) changed since the zygote started, a new
zygote is started under the new environment. Every other variable is set in the rank before the
worker reads it; the two the launcher sets that are read at start-up are re-applied by hand
(``OMP_NUM_THREADS`` through ``torch.set_num_threads`` in the worker, ``PYTHONUNBUFFERED`` by
line-buffering stdout).

Parent death: the fork server exits when the process that started it dies (its end of a pipe
closes), and each rank asks the kernel for SIGKILL when the fork server dies, so a killed launcher
still leaves no rank behind (tests/integration/test_failures.py kills one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import subprocess
import sys
import types
from multiprocessing import forkserver, reduction

from parallel_lab.comm.dist_env import cuda_gpus
from parallel_lab.protocol import RANK_START_ENV

# What every rank imports anyway, loaded once into the fork server. DeepSpeed is left out: it
# probes devices and reads its environment (DS_ACCELERATOR) at import.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "parallel_lab.strategies",
    "parallel_lab.worker.train",
    "parallel_lab.worker.main",
    "parallel_lab.worker.zygote",
]
# Variables read before a rank's own environment is in place: by the interpreter, or while PRELOAD
# is imported (libgomp/MKL thread pools, torch's kernel choice and logging, the dynamic loader),
# or once per process by a kernel library (oneDNN's instruction set: ONEDNN_/DNNL_MAX_CPU_ISA).
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "ATEN_",
    "ONEDNN_",
    "DNNL_",
    "TORCH",
    "PYTORCH_",
)
# Set per run by the launcher and re-applied in the rank (see the module docstring), or set in
# the parent by libraries it imported later and read only when used (a cache folder; how
# torch.cuda counts GPUs): neither needs a new zygote.
NOT_COMPARED = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"}


@dataclasses.dataclass
class Zygote:
    """The running fork server (multiprocessing keeps one per process): its pid, and os.environ
    when it started."""

    pid: int | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)


# The module's one piece of state (allowed in tests/unit/test_module_state.py), mirroring
# multiprocessing's own: a changed pid means the fork server was (re)started.
_zygote = Zygote()


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in NOT_COMPARED}


def context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's fork-server context with PRELOAD, its server running (started now if it
    is not): the one zygote of this process, shared with parallel_lab.cli.run.run_ranks."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    pid = forkserver._forkserver._forkserver_pid  # changes when it was (re)started
    if pid != _zygote.pid:
        _zygote.env, _zygote.pid = dict(os.environ), pid
    return ctx


def can_fork(device: str, env: dict[str, str]) -> bool:
    """True when a rank with this environment may be forked from the zygote (module docstring).
    A zygote started under another import-time environment is replaced by a new one first."""
    if device != "cpu" or not sys.platform.startswith("linux") or cuda_gpus():
        return False
    context()
    if _import_time_env(env) != _import_time_env(_zygote.env) and hasattr(forkserver._forkserver, "_stop"):
        forkserver._forkserver._stop()  # ends it; the next context() starts one afresh
        context()
    return _import_time_env(env) == _import_time_env(_zygote.env)


class _InheritFd:
    """A file descriptor the fork server passes to the rank it forks (SCM_RIGHTS): pickled only
    while the rank's start request is being sent, which is when multiprocessing can send fds."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _identity, (reduction.DupFd(self.fd),)


def _identity(value):
    return value


def _rank_main(argv: list[str], env: dict[str, str], stdout, stderr, zygote_pid: int) -> None:
    """In the forked rank: the launcher's stdout/stderr, its own session and environment, then the
    worker's main() exactly as ``python -m parallel_lab.worker`` runs it."""
    os.setsid()  # like start_new_session=True: the launcher signals the rank's whole group
    for fd, inherited in ((1, stdout), (2, stderr)):
        received = inherited.detach()
        os.dup2(received, fd)
        os.close(received)
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.argv[0], *argv]
    from parallel_lab.worker.main import main

    if os.getppid() != zygote_pid:  # the zygote died before this rank could ask to die with it
        os._exit(1)
    sys.exit(main(argv))


class ForkedRank:
    """A forked rank with the few subprocess.Popen members the launcher's supervisor uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.process.exitcode


@contextlib.contextmanager
def _main_module_hidden():
    """multiprocessing re-runs the parent's ``__main__`` script in every child it starts (its
    "safe importing of main module" rule): a user's script that calls parallel_lab without an
    ``if __name__ == "__main__"`` guard would run again in each rank. The ranks need nothing from
    it, so while a rank is being started ``__main__`` is a bare module with nothing to re-run."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def start_process(target, args: tuple, name: str) -> multiprocessing.process.BaseProcess:
    """Start target(*args) in a process forked from the zygote."""
    process = context().Process(target=target, args=args, name=name, daemon=True)
    with _main_module_hidden():
        process.start()
    return process


def start_rank(argv: list[str], env: dict[str, str]) -> ForkedRank:
    """Fork one worker rank (``python -m parallel_lab.worker`` arguments argv) from the zygote."""
    context()  # first: the zygote's pid the rank checks its parent against
    args = (argv, {**env, RANK_START_ENV: "fork"}, _InheritFd(1), _InheritFd(2), _zygote.pid)
    return ForkedRank(start_process(_rank_main, args, name=f"parallel_lab rank {env.get('RANK')}"))
