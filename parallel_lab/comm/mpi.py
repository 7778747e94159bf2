"""All-reduce over MPI (mpi4py) instead of a torch process group: ``manual_ddp``'s
``strategy.allreduce=mpi`` transport, for ranks started by ``mpiexec`` (``launcher=mpirun``).

The gradient bucket is handed to MPI without a copy: ``tensor.numpy()`` of a contiguous CPU tensor
is a numpy array over the same memory, and ``Allreduce(MPI.IN_PLACE, array)`` sums into it, so the
reduced values land straight in the bucket (and hence in every ``p.grad`` view of it). The MPI
library picks its own algorithm (MPICH: recursive doubling for small messages, Rabenseifner's
reduce-scatter + all-gather for large ones, Thakur et al., IJHPCA 2005), which moves about
2(N-1)/N x B per rank, as the ring does.

The torch process group (gloo) still does everything else (the initial broadcast, loss averaging,
checkpoints); MPI's COMM_WORLD must therefore be the same ranks in the same order, which holds
under ``mpiexec`` because ``parallel_lab.comm.dist_env`` takes the torch ranks from the MPI
launcher's variables. ``world()`` checks it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world(threads: bool = False):
    """MPI.COMM_WORLD, checked to be the torch world (same size, same rank). Importing mpi4py
    initialises MPI, so call this from the main thread before any other thread uses MPI; with
    ``threads`` the library must allow a non-main thread to call it (MPI_THREAD_SERIALIZED or
    more: mpi4py asks for MULTIPLE by default, MPICH grants it)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch_rank, torch_size = dist.get_rank(), dist.get_world_size()
    if (comm.Get_rank(), comm.Get_size()) != (torch_rank, torch_size):
        raise RuntimeError(
            f"MPI's COMM_WORLD is rank {comm.Get_rank()} of {comm.Get_size()} but torch.distributed is rank "
            f"{torch_rank} of {torch_size}: strategy.allreduce=mpi needs every rank started by mpiexec "
            f"(launcher=mpirun)"
        )
    if threads and MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            f"MPI was initialised with thread level {MPI.Query_thread()}, below MPI_THREAD_SERIALIZED, but the "
            f"bucketed all-reduce calls MPI from its communication thread; use strategy.bucketed=false"
        )
    return comm


def all_reduce_sum(flat: torch.Tensor) -> None:
    """Sum a contiguous CPU tensor over every MPI rank, in place, through a zero-copy numpy view."""
    from mpi4py import MPI

    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError(f"MPI all-reduce needs a contiguous CPU tensor, got one on {flat.device}")
    view = flat.numpy()  # shares flat's memory: MPI reads and writes the tensor itself
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
