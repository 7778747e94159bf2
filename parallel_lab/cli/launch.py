"""Start the worker processes of one run and supervise them (parent process only).

``launcher=spawn`` (default) starts ``world_size`` copies of ``python -m parallel_lab.worker``
itself, with RANK/WORLD_SIZE/LOCAL_RANK and a free rendezvous port on 127.0.0.1.
``launcher=torchrun``, ``deepspeed``, ``mpirun`` and ``slurm`` (srun) run those real tools with the
same worker command; ``launch/*.sh`` show the raw commands. On several hosts (``launcher.hosts``)
each tool runs in its multi-node form (parallel_lab/cli/multinode.py). In every case, if one rank
fails, every rank is stopped and the failing rank's traceback is shown once.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.cli import multinode
from parallel_lab.cli.multinode import WORKER, deepspeed_argv
from parallel_lab.comm.dist_env import DEFAULT_PORT, free_port
from parallel_lab.errors import ConfigError
from parallel_lab.protocol import CONFIG_FILE, ERRORS_DIR, SUPERVISED_ENV, set_parent_death_signal
from parallel_lab.worker import zygote


@dataclass
class Proc:
    rank: int | None  # None: a launcher tool that owns several ranks
    popen: subprocess.Popen | zygote.ForkedRank


def find_tool(name: str, install_hint: str) -> str:
    """Prefer the tool installed next to this interpreter (the project's .venv), then PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise ConfigError(f"launcher needs '{name}' but it is not installed; {install_hint}")
    return found


def rendezvous_port(cfg: DictConfig) -> int:
    """launcher.master_port, checked free; 0 = a free one. Where the rendezvous host is not this
    machine (several hosts), neither can be checked here: 0 then means the default port."""
    port = cfg.launcher.master_port
    addr = cfg.launcher.master_addr or "127.0.0.1"
    if multinode.is_multi_node(cfg) and not _is_local_address(addr):
        return port or DEFAULT_PORT
    if not port:
        return free_port(addr)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, port))
        except OSError:
            raise ConfigError(
                f"launcher.master_port={port} is already in use; pick another port "
                f"or launcher.master_port=0 for a free one"
            ) from None
    return port


def _is_local_address(addr: str) -> bool:
    """Whether this machine owns addr (a bind to it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:  # not an address of this host, or a name that does not resolve here
            return False
    return True


def base_env(cfg: DictConfig, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR=cfg.launcher.master_addr or "127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(cfg.trainer.threads),  # the deepspeed launcher does not set it
        PYTHONUNBUFFERED="1",
        **{SUPERVISED_ENV: "1"},
    )
    return env


# What a launcher starts: (rank, or None for a tool that starts several ranks; argv; environment).
Command = tuple[int | None, list[str], dict[str, str]]


def spawn_commands(cfg: DictConfig, config_path: Path, port: int) -> list[Command]:
    commands = []
    for rank in range(cfg.world_size):
        env = base_env(cfg, port)
        env.update(RANK=str(rank), WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(rank))
        commands.append((rank, [sys.executable, *WORKER, str(config_path)], env))
    return commands


def torchrun_commands(cfg: DictConfig, config_path: Path, port: int) -> list[Command]:
    if multinode.is_multi_node(cfg):
        return multinode.torchrun_multi_node(cfg, config_path, port, base_env(cfg, port))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={cfg.world_size}",
        f"--master_addr={cfg.launcher.master_addr}",
        f"--master_port={port}",
        f"--max_restarts={cfg.launcher.max_restarts}",
        *cfg.launcher.extra_args,
        *WORKER,
        str(config_path),
    ]
    return [(None, cmd, base_env(cfg, port))]


def deepspeed_commands(cfg: DictConfig, config_path: Path, port: int) -> list[Command]:
    tool = find_tool("deepspeed", "install it with pip install 'parallel_lab[deepspeed]' (make installs it)")
    if multinode.is_multi_node(cfg):
        return multinode.deepspeed_multi_node(cfg, config_path, port, tool, base_env(cfg, port))
    # --num_gpus is the local process count; on CPU it starts that many ranks (docs/facts.md).
    cmd = deepspeed_argv(tool, ["--num_nodes", "1", "--num_gpus", str(cfg.world_size)], cfg, config_path, port)
    return [(None, cmd, base_env(cfg, port))]


def mpirun_commands(cfg: DictConfig, config_path: Path, port: int) -> list[Command]:
    tool = find_tool("mpiexec", "install MPI with pip install mpi4py mpich (make installs it)")
    env = base_env(cfg, port)
    flags = []
    open_mpi = "Open MPI" in subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout
    if open_mpi:
        flags = [
            "--oversubscribe",
            *[f"-x{v}" for v in ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", SUPERVISED_ENV)],
        ]
    if multinode.is_multi_node(cfg):
        # Rendezvous on rank 0's host, which the workers agree on over MPI (dist_env).
        env = multinode.without_rendezvous(cfg, env)
        flags = [f for f in flags if f not in ("-xMASTER_ADDR", "-xMASTER_PORT") or "MASTER_ADDR" in env]
        flags += multinode.mpiexec_host_flags(cfg, config_path, open_mpi)
    cmd = [tool, "-n", str(cfg.world_size), *flags, *cfg.launcher.extra_args, sys.executable, *WORKER, str(config_path)]
    return [(None, cmd, env)]


def slurm_commands(cfg: DictConfig, config_path: Path, port: int) -> list[Command]:
    """srun starts every rank; without launcher.master_addr the workers take rank 0's node from
    the allocation (dist_env), the port is the one picked here."""
    tool = find_tool("srun", "run inside a Slurm cluster (Debian: apt-get install slurm-client)")
    env = base_env(cfg, port)
    if cfg.launcher.master_addr is None:
        env.pop("MASTER_ADDR")
    return [(None, multinode.srun_command(cfg, config_path, tool), env)]


LAUNCHERS = {
    "spawn": spawn_commands,
    "torchrun": torchrun_commands,
    "deepspeed": deepspeed_commands,
    "mpirun": mpirun_commands,
    "slurm": slurm_commands,
}


def launcher_commands(cfg: DictConfig, config_path: Path, port: int) -> list[Command]:
    if cfg.launcher.name not in LAUNCHERS:
        raise ConfigError(
            f"unknown launcher '{cfg.launcher.name}'; choose one of: {', '.join(LAUNCHERS)} (launcher=<name>)"
        )
    return LAUNCHERS[cfg.launcher.name](cfg, config_path, port)


def _stop(procs: list[Proc]) -> None:
    """SIGTERM whatever still runs, then SIGKILL after a moment: nothing is left behind."""
    for proc in procs:
        if proc.popen.poll() is None:
            _signal_group(proc.popen, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc.popen, signal.SIGKILL)
            proc.popen.wait()


def _signal_group(popen: subprocess.Popen | zygote.ForkedRank, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)  # the tool and every rank it started
    except ProcessLookupError:
        try:
            os.kill(popen.pid, sig)  # a forked rank stopped before its setsid()
        except ProcessLookupError:
            pass


# Without an exit to wait on (no pidfd), the supervisor looks every POLL_S; with one it wakes at
# an exit, or every WAKE_S at the latest.
POLL_S, WAKE_S = 0.05, 1.0


def supervise(procs: list[Proc], grace_s: float, required: int | None = None) -> int:
    """Wait for all; after the first failure give the rest grace_s to exit, then stop them.
    required=k (an elastic torchrun run): only the first k may not fail; a later host's agent that
    dies leaves the group to torchrun, which re-forms it without that host. It sleeps until a
    process ends (``_exits``: each one's exit as a file descriptor), not in 50 ms steps: a run's
    end was seen up to 50 ms late, on average 25 ms a run (the demo and make test start hundreds)."""
    failed_at = None
    required = len(procs) if required is None else required
    exits = _exits(procs)
    try:
        while True:
            codes = [p.popen.poll() for p in procs]
            if all(c is not None for c in codes[:required]) and (
                required < len(procs) or all(c is not None for c in codes)
            ):
                break
            if failed_at is None and any(c not in (None, 0) for c in codes[:required]):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                _stop(procs)
                break
            live = [fd for fd, code in zip(exits, codes) if code is None]
            wait_s = WAKE_S if None not in live else POLL_S
            if failed_at is not None:
                wait_s = min(wait_s, max(0.0, grace_s - (time.monotonic() - failed_at)) + POLL_S)
            multiprocessing.connection.wait([fd for fd in live if fd is not None], timeout=wait_s)
    finally:
        for proc, fd in zip(procs, exits):
            if fd is not None and not isinstance(proc.popen, zygote.ForkedRank):
                os.close(fd)
    codes = [p.popen.returncode for p in procs[:required]]
    return next((c for c in codes if c != 0), 0)


def _exits(procs: list[Proc]) -> list[int | None]:
    """Per process a file descriptor that becomes readable when it ends: a forked rank's sentinel,
    a subprocess's pidfd (Linux 5.3+); None where there is none (the supervisor then polls)."""
    fds: list[int | None] = []
    for proc in procs:
        if isinstance(proc.popen, zygote.ForkedRank):
            fds.append(proc.popen.process.sentinel)
            continue
        try:
            fds.append(os.pidfd_open(proc.popen.pid))
        except (AttributeError, OSError):  # no pidfd here, or the process is gone already
            fds.append(None)
    return fds


def _raise_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise SystemExit(128 + signum)  # unwinds through launch()'s finally, which stops the workers


def _fork_spawned_ranks(cfg: DictConfig, commands: list[Command]) -> bool:
    """launcher=spawn on CPU forks its ranks from the preloaded zygote (parallel_lab.worker.zygote)
    when nothing the ranks read at start-up differs from the zygote's environment."""
    if cfg.launcher.name != "spawn" or not cfg.launcher.fork_ranks:
        return False
    return all(zygote.can_fork(cfg.device, env) for _, _, env in commands)


def run_processes(commands: list[Command], fork: bool = False) -> list[Proc]:
    procs = []
    try:
        for rank, cmd, env in commands:
            if fork:
                procs.append(Proc(rank, zygote.start_rank(cmd[len(WORKER) + 1 :], env)))
                continue
            # A new session per child so the stop signal reaches a launcher tool's own children too.
            # In the child before exec: SIGTERM it if this parent dies, so a launcher tool
            # (torchrun, mpiexec) in its own session still stops and takes its ranks along.
            procs.append(
                Proc(
                    rank,
                    subprocess.Popen(
                        cmd,
                        env=env,
                        start_new_session=True,
                        preexec_fn=partial(set_parent_death_signal, signal.SIGTERM),
                    ),
                )
            )
    except BaseException:
        _stop(procs)
        raise
    return procs


def first_failure(run_dir: Path) -> tuple[str, str, str] | None:
    """(rank, one-line summary, traceback) of the rank that failed first, from errors/rank<k>.txt."""
    files = sorted((run_dir / ERRORS_DIR).glob("rank*.txt"))
    if not files:
        return None
    parsed = []
    for path in files:
        stamp_kind, summary, text = (path.read_text().split("\n", 2) + ["", ""])[:3]
        stamp, _, kind = stamp_kind.partition(" ")
        parsed.append((float(stamp or 0), path.stem[4:], kind, summary, text))
    # A bad-input error beats the peers' secondary errors ("connection closed by peer").
    parsed.sort(key=lambda item: (item[2] != "config", item[0]))
    _, rank, kind, summary, text = parsed[0]
    return rank, summary, "" if kind == "config" else text


def launch(cfg: DictConfig, run_dir: Path) -> int | None:
    """Start the run's processes, wait for them, return 0 or the first non-zero exit code; None
    when nothing was started because the per-host commands were printed for the user to run."""
    config_path = run_dir / CONFIG_FILE
    port = rendezvous_port(cfg)
    if cfg.launcher.name == "torchrun" and multinode.is_multi_node(cfg) and not cfg.launcher.remote_shell:
        multinode.print_per_host_commands(cfg, config_path, port)
        return None
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    procs = []
    try:
        commands = launcher_commands(cfg, config_path, port)
        procs = run_processes(commands, fork=_fork_spawned_ranks(cfg, commands))
        elastic = cfg.launcher.name == "torchrun" and cfg.launcher.get("min_nodes") is not None
        return supervise(procs, cfg.launcher.grace_s, required=1 if elastic else None)
    finally:
        _stop(procs)  # also on KeyboardInterrupt or SIGTERM: no orphan workers
        signal.signal(signal.SIGTERM, previous)
