"""The one place that reads rank, world size and device from the environment.

Every launcher leaves its own variables: torchrun, the deepspeed launcher and our spawn launcher
set RANK/WORLD_SIZE/LOCAL_RANK; Open MPI sets OMPI_COMM_WORLD_*; MPICH sets PMI_RANK/PMI_SIZE/
MPI_LOCALRANKID; PMIx sets PMIX_RANK; Slurm sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID. The
rendezvous address comes from MASTER_ADDR/MASTER_PORT, or, under MPI without them, rank 0 picks a
free port on 127.0.0.1 and broadcasts it over MPI.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from parallel_lab.errors import ConfigError

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


def _port_from_mpi() -> int:
    """Rank 0 picks a free loopback port and tells the others over MPI (mpirun without MASTER_PORT)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)


def pick_device(requested: str, local_rank: int) -> tuple[torch.device, str]:
    """cuda:{local_rank} + nccl when CUDA is there (or asked for), else cpu + gloo."""
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")
    if use_cuda:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}"), "nccl"
    return torch.device("cpu"), "gloo"


def read_dist_env(requested_device: str = "auto", environ=None) -> DistEnv:
    environ = os.environ if environ is None else environ
    rank, world, local, source = read_rank(environ)
    addr = environ.get("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in environ:
        port = int(environ["MASTER_PORT"])
    elif world > 1 and any(k in environ for k in MPI_MARKERS):
        port = _port_from_mpi()
    elif world == 1:
        port = free_port(addr)  # no peer to agree with, and the default port may be taken
    else:
        port = DEFAULT_PORT
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
        torch.cuda.set_device(env.device)
    timeout = timedelta(seconds=timeout_s)
    common = dict(backend=env.backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
    if env.agent_store:
        # torchrun keeps ONE rendezvous store for all restarts of the group: the keys a killed
        # attempt left there made the restarted ranks wait forever in init (seen 1 run in 2).
        # A fresh key prefix per attempt is a clean rendezvous.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(store=dist.PrefixStore(f"parallel_lab/attempt_{env.restart_count}", store), **common)
        return
    dist.init_process_group(init_method=f"tcp://{env.master_addr}:{env.master_port}", **common)
