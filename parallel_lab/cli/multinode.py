"""The launch commands for runs across several hosts (``launcher.hosts`` / ``launcher.hostfile``).

Each real engine in its own multi-node form (docs/multinode.md):

- torchrun: one agent per host (``--nnodes``, ``--node_rank``, static rendezvous on
  ``launcher.master_addr``), each started by this parent through ``launcher.remote_shell``
  (ssh), or printed as the exact per-host command when it cannot reach the hosts;
- deepspeed: ``--hostfile`` (``host slots=N``) through one of DeepSpeed's multi-node runners
  (``launcher.ds_runner``: pdsh by default, or mpich, openmpi, ...);
- mpirun: MPICH hydra ``mpiexec -f <hostfile>`` (``host:N``); the workers find rank 0's host
  address over MPI (parallel_lab/comm/dist_env.py);
- slurm: ``srun``; ranks from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, the rendezvous host from
  the allocation.

The run folder must be on a filesystem every host sees (NFS, as on most clusters): every rank
reads ``config.yaml`` from it and rank 0 writes ``metrics.json`` into it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.config.hosts import remote_shell
from parallel_lab.errors import ConfigError
from parallel_lab.protocol import SUPERVISED_ENV

WORKER = ["-m", "parallel_lab.worker"]
# Variables a remote host needs to see as this one does (an ssh session starts with a fresh
# environment). PATH too: a different ninja on PATH makes DeepSpeed recompile its op (docs/facts.md).
FORWARDED_ENV = (
    "PATH",
    "PYTHONPATH",
    "TORCH_EXTENSIONS_DIR",
    "DS_ACCELERATOR",
    "GLOO_SOCKET_IFNAME",
    "UCX_TLS",
    "ATEN_CPU_CAPABILITY",
)


def is_multi_node(cfg: DictConfig) -> bool:
    return (cfg.launcher.nodes or 1) > 1


def worker_env(cfg: DictConfig) -> dict[str, str]:
    """What every rank needs besides the launcher's own variables, on whichever host it runs."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env.update(OMP_NUM_THREADS=str(cfg.trainer.threads), PYTHONUNBUFFERED="1", **{SUPERVISED_ENV: "1"})
    return env


ELASTIC_RESTARTS = 3  # launcher.min_nodes with max_restarts=0: re-forming the group IS a restart


def static_flags(cfg: DictConfig, port: int, node_rank: int) -> list[str]:
    """A fixed group: every host's rank known in advance, the rendezvous on host 0."""
    launcher = cfg.launcher
    return [
        f"--nnodes={launcher.nodes}",
        f"--node_rank={node_rank}",
        f"--master_addr={launcher.master_addr}",
        f"--master_port={port}",
    ]


def elastic_flags(cfg: DictConfig, port: int) -> list[str]:
    """launcher.min_nodes: torchrun's elastic group (--nnodes=K:N), its c10d rendezvous store on host 0
    (the agent whose host is the endpoint serves it); node ranks are handed out at each rendezvous.
    The run folder names the rendezvous, so two runs on the same hosts never meet."""
    launcher = cfg.launcher
    return [
        f"--nnodes={launcher.min_nodes}:{launcher.nodes}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={launcher.master_addr}:{port}",
        f"--rdzv_id={Path(cfg.run_dir).name if cfg.run_dir else 'parallel_lab'}",
        "--rdzv_conf=join_timeout=60,last_call_timeout=5",
    ]


def torchrun_host_command(cfg: DictConfig, config_path: Path, port: int, node_rank: int) -> str:
    """The shell line that starts host `node_rank`'s torchrun agent (what ssh runs there)."""
    launcher = cfg.launcher
    elastic = launcher.get("min_nodes") is not None
    restarts = launcher.max_restarts or (ELASTIC_RESTARTS if elastic else 0)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(elastic_flags(cfg, port) if elastic else static_flags(cfg, port, node_rank)),
        f"--nproc_per_node={launcher.nproc_per_node}",
        f"--max_restarts={restarts}",
        *launcher.extra_args,
        *WORKER,
        str(config_path),
    ]
    env = worker_env(cfg)
    if elastic:
        # Not the agents' shared rendezvous store: each round's workers make a fresh one. A host
        # that joins later counts its restarts from 0 while the others do not, so the per-attempt
        # key prefix on a shared store (comm/dist_env.py) would differ between ranks.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    assignments = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    return f"cd {shlex.quote(os.getcwd())} && env {' '.join(assignments)} {shlex.join(argv)}"


def per_host_commands(cfg: DictConfig, config_path: Path, port: int) -> list[tuple[str, str]]:
    return [(host, torchrun_host_command(cfg, config_path, port, i)) for i, host in enumerate(cfg.launcher.hosts)]


def print_per_host_commands(cfg: DictConfig, config_path: Path, port: int) -> None:
    print(
        f"launcher.remote_shell is null: run each line on its host ({cfg.launcher.nodes} hosts x "
        f"{cfg.launcher.nproc_per_node} ranks; {config_path.parent} must be visible to all of them):",
        flush=True,
    )
    for host, line in per_host_commands(cfg, config_path, port):
        print(f"[{host}] {line}", flush=True)


def torchrun_multi_node(cfg: DictConfig, config_path: Path, port: int, base_env: dict[str, str]) -> list:
    """One agent per host, each through the remote shell (rank None: the agent owns its ranks;
    validate() probed every host: config/hosts.py ``check_reachable``)."""
    shell = remote_shell(cfg)
    return [(None, [*shell, host, line], base_env) for host, line in per_host_commands(cfg, config_path, port)]


def write_hostfile(cfg: DictConfig, config_path: Path, style: str) -> Path:
    """<run_dir>/hostfile in DeepSpeed's ('host slots=N') or MPICH's ('host:N') form."""
    n = cfg.launcher.nproc_per_node
    path = config_path.parent / "hostfile"
    lines = [f"{h} slots={n}" if style == "deepspeed" else f"{h}:{n}" for h in cfg.launcher.hosts]
    path.write_text("\n".join(lines) + "\n")
    return path


def deepspeed_multi_node(cfg: DictConfig, config_path: Path, port: int, tool: str, env: dict[str, str]) -> list:
    """deepspeed --hostfile through its runner; the variables each host needs go in a DeepSpeed
    environment file (DS_ENV_FILE, the '.deepspeed_env' format), which every runner exports."""
    runner = cfg.launcher.ds_runner
    if runner == "pdsh" and not shutil.which("pdsh"):
        raise ConfigError(
            "launcher.ds_runner=pdsh needs pdsh on this host (Debian: apt-get install pdsh); install it "
            "or pick another runner (launcher.ds_runner=openmpi, slurm, ...)"
        )
    env_file = config_path.parent / "deepspeed_env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in worker_env(cfg).items() if k != "PATH"))
    env = {**env, "DS_ENV_FILE": str(env_file), "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"}
    placement = ["--hostfile", str(write_hostfile(cfg, config_path, "deepspeed")), "--launcher", runner]
    return [(None, deepspeed_argv(tool, placement, cfg, config_path, port), env)]


def deepspeed_argv(tool: str, placement: list[str], cfg: DictConfig, config_path: Path, port: int) -> list[str]:
    """``deepspeed <placement flags> --master_addr A --master_port P <extra> --module parallel_lab.worker <config>``."""
    rendezvous = ["--master_addr", cfg.launcher.master_addr, "--master_port", str(port)]
    return [tool, *placement, *rendezvous, *cfg.launcher.extra_args, "--module", *WORKER[1:], str(config_path)]


def mpiexec_host_flags(cfg: DictConfig, config_path: Path, open_mpi: bool) -> list[str]:
    """Open MPI: --host a:N,b:N. MPICH hydra: -f <hostfile>, and the remote shell if it is not ssh."""
    n = cfg.launcher.nproc_per_node
    if open_mpi:
        return ["--host", ",".join(f"{h}:{n}" for h in cfg.launcher.hosts)]
    flags = ["-f", str(write_hostfile(cfg, config_path, "mpich"))]
    shell = remote_shell(cfg)
    if shell and Path(shell[0]).name != "ssh":
        flags += ["-launcher", "ssh", "-launcher-exec", shell[0]]
    return flags


def without_rendezvous(cfg: DictConfig, env: dict[str, str]) -> dict[str, str]:
    """mpirun/slurm with launcher.master_addr null: the workers find rank 0's host themselves."""
    if cfg.launcher.master_addr is None:
        return {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return env


def srun_command(cfg: DictConfig, config_path: Path, tool: str) -> list[str]:
    launcher = cfg.launcher
    nodelist = [f"--nodelist={','.join(launcher.hosts)}"] if launcher.hosts else []
    return [
        tool,
        f"--nodes={launcher.nodes}",
        f"--ntasks={cfg.world_size}",
        f"--ntasks-per-node={launcher.nproc_per_node}",
        "--kill-on-bad-exit=1",  # one failed rank ends the step
        "--job-name=parallel_lab",
        *nodelist,
        *launcher.extra_args,
        sys.executable,
        *WORKER,
        str(config_path),
    ]
