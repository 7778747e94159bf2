"""The one place that reads rank, world size and device from the environment.

Every launcher leaves its own variables: torchrun, the deepspeed launcher and our spawn launcher
set RANK/WORLD_SIZE/LOCAL_RANK; Open MPI sets OMPI_COMM_WORLD_*; MPICH sets PMI_RANK/PMI_SIZE/
MPI_LOCALRANKID; PMIx sets PMIX_RANK; Slurm sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID. The
rendezvous address comes from MASTER_ADDR/MASTER_PORT. Under MPI without them, rank 0 broadcasts
its host address (127.0.0.1 when every rank shares its host) and a free port over MPI. Under Slurm
without MASTER_ADDR it is rank 0's node in the allocation (its NodeAddr), the port one per job.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from parallel_lab.errors import ConfigError

if TYPE_CHECKING:  # the parent imports this module (ports, launcher names) and never needs torch
    import torch

# (rank, world size, local rank) variable names, in order of precedence.
_RANK_SOURCES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
MPI_MARKERS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    device: torch.device
    backend: str
    source: str  # which launcher's variables we read
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: 0 in the first attempt
    agent_store: bool = False  # torchrun's agent hosts the rendezvous store on master_port

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_rank(environ) -> tuple[int, int, int, str]:
    for rank_key, size_key, local_key in _RANK_SOURCES:
        if rank_key in environ and size_key in environ:
            rank, size = int(environ[rank_key]), int(environ[size_key])
            local = int(environ.get(local_key, rank))
            return rank, size, local, rank_key
    return 0, 1, 0, "none"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _rank0_rendezvous(addr: str | None, hostnames: list[str]) -> tuple[str | None, int, str]:
    """On rank 0: (address, free port, error). Loopback when every rank runs on this host; else this
    host's address, which must not be loopback (peers on other hosts could not reach it)."""
    if addr is None and len(set(hostnames)) == 1:
        addr = "127.0.0.1"
    elif addr is None:
        addr = socket.gethostbyname(hostnames[0])
        if ipaddress.ip_address(addr).is_loopback:
            return (
                None,
                0,
                (
                    f"rank 0's host name '{hostnames[0]}' resolves to {addr}, which ranks on the other hosts cannot "
                    f"reach; map it to the host's network address (/etc/hosts or DNS) or set launcher.master_addr"
                ),
            )
    return addr, free_port(addr), ""


def _rendezvous_from_mpi(addr: str | None) -> tuple[str, int]:
    """mpirun without MASTER_ADDR/MASTER_PORT: the ranks agree on rank 0's host over MPI."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    hostnames = comm.gather(socket.gethostname(), root=0)
    found = _rank0_rendezvous(addr, hostnames) if comm.Get_rank() == 0 else None
    addr, port, error = comm.bcast(found, root=0)
    if error:
        raise ConfigError(error)
    return addr, port


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def slurm_rendezvous_host(environ) -> str:
    """Rank 0's node (the first of the step's nodes, block distribution) as Slurm reaches it: its
    NodeAddr, which is the node name unless slurm.conf says otherwise (127.0.0.1 for nodes that
    share one host)."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    first = _scontrol("show", "hostnames", nodelist).split()[0]
    found = re.search(r"NodeAddr=(\S+)", _scontrol("show", "node", first, "-o"))
    return found[1] if found else first


def slurm_port(environ) -> int:
    """One port per job, the same on every rank without talking: 20000 + job id mod 20000."""
    return 20000 + int(environ.get("SLURM_JOB_ID", 0)) % 20000


# Where a GPU driver shows itself without torch: NVIDIA's kernel module and device nodes, and ROCm's
# /dev/kfd (torch.cuda covers both). Where none of them exists torch sees no GPU either.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidia[0-9]*", "/dev/kfd")


def cuda_gpus() -> int:
    """The CUDA GPUs torch sees here. Without a GPU driver 0, and torch is not imported: the parent
    (about 1.5 s of CPU to import it) and the zygote's check need no more."""
    if not any(glob.glob(pattern) for pattern in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_device(requested: str, local_rank: int) -> tuple[torch.device, str]:
    """cuda:{local_rank} + nccl when CUDA is there (or asked for), else cpu + gloo."""
    import torch

    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")
    if use_cuda:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}"), "nccl"
    return torch.device("cpu"), "gloo"


def read_dist_env(requested_device: str = "auto", environ=None) -> DistEnv:
    environ = os.environ if environ is None else environ
    rank, world, local, source = read_rank(environ)
    addr = environ.get("MASTER_ADDR")
    slurm = source == "SLURM_PROCID" and world > 1
    if addr is None and slurm:
        addr = slurm_rendezvous_host(environ)
    if "MASTER_PORT" in environ:
        port = int(environ["MASTER_PORT"])
    elif world > 1 and any(k in environ for k in MPI_MARKERS):
        addr, port = _rendezvous_from_mpi(addr)
    elif slurm:
        port = slurm_port(environ)
    elif world == 1:
        port = free_port(addr or "127.0.0.1")  # no peer to agree with, and the default port may be taken
    else:
        port = DEFAULT_PORT
    addr = addr or "127.0.0.1"
    device, backend = pick_device(requested_device, local)
    restarts = int(environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return DistEnv(rank, world, local, addr, port, device, backend, source, restarts, agent_store)


def export_rendezvous(env: DistEnv) -> None:
    """Make the standard variables true for libraries that read them (DeepSpeed under MPI does
    its own discovery, which picks a non-loopback address, unless all five are set)."""
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )


def init_process_group(env: DistEnv, timeout_s: int) -> None:
    """The default process group of this rank; one that already exists (made by a script or a
    test body that trains several configs in one set of ranks) is adopted as it is."""
    import torch.distributed as dist

    export_rendezvous(env)
    if dist.is_initialized():
        return
    if env.device.type == "cuda":
        import torch

        torch.cuda.set_device(env.device)
    timeout = timedelta(seconds=timeout_s)
    common = dict(backend=env.backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
    if env.device.type == "cuda":
        # NCCL binds the group to this GPU now, rather than guessing at the first barrier (which
        # warns "using the device under current context" on every rank).
        common["device_id"] = env.device
    if env.agent_store:
        # torchrun keeps ONE rendezvous store for all restarts of the group: the keys a killed
        # attempt left there made the restarted ranks wait forever in init (seen 1 run in 2).
        # A fresh key prefix per attempt is a clean rendezvous.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(store=dist.PrefixStore(f"parallel_lab/attempt_{env.restart_count}", store), **common)
        return
    dist.init_process_group(init_method=f"tcp://{env.master_addr}:{env.master_port}", **common)
