"""Ring all-reduce by hand, from Sendrecv, checked against MPI's own Allreduce.

    mpiexec -n 4 python mpi_examples/ring_allreduce.py [n]   # vector length, default 1_000_003
    python mpi_examples/ring_allreduce.py [n]

The vector is cut into p chunks (p = ranks; lengths may differ by one). Ranks form a ring
r -> r+1. Two phases of p-1 steps each, every step one Sendrecv to the right / from the left:
  1. reduce-scatter: at step s rank r sends chunk (r-s) and adds the incoming chunk (r-s-1) into
     its own copy. After p-1 steps rank r holds the FULL sum of chunk (r+1).
  2. all-gather: at step s rank r sends chunk (r+1-s), the finished one it received last, and
     overwrites chunk (r-s) with what arrives. After p-1 steps everyone has every summed chunk.
Each rank sends 2(p-1)/p of the vector in total, whatever p is: that is why the ring is
bandwidth-optimal and why "bus bandwidth" = algorithm bandwidth * 2(p-1)/p.
Sendrecv sends and receives at once, so the ring cannot deadlock the way p blocking Sends can.
"""

import sys
import time

import numpy as np
from common import abort_on_exception, positive_int_arg
from mpi4py import MPI


def ring_allreduce(comm, x: np.ndarray) -> np.ndarray:
    """Sum of x over all ranks of comm, on every rank, by the chunked ring."""
    rank, p = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    out = x.copy()
    chunks = np.array_split(out, p)  # views into `out`: writing a chunk writes `out`
    incoming = np.empty(max(len(c) for c in chunks), dtype=x.dtype)
    for s in range(p - 1):  # phase 1: reduce-scatter
        send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        comm.Sendrecv(send, dest=right, sendtag=s, recvbuf=incoming[: len(recv)], source=left, recvtag=s)
        recv += incoming[: len(recv)]
    for s in range(p - 1):  # phase 2: all-gather (received chunks are final: write them in place)
        send, recv = chunks[(rank + 1 - s) % p], chunks[(rank - s) % p]
        comm.Sendrecv(send, dest=right, sendtag=p + s, recvbuf=recv, source=left, recvtag=p + s)
    return out


def main() -> int:
    abort_on_exception()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = positive_int_arg(1, "n", 1_000_003)  # the odd default makes the chunks unequal

    # Integer-valued floats: every summation order gives the same bits, so we can demand equality.
    ints = np.random.default_rng(rank).integers(-1000, 1000, n).astype(np.float64)
    mine, reference = ring_allreduce(comm, ints), np.empty(n)
    comm.Allreduce(ints, reference, op=MPI.SUM)
    assert np.array_equal(mine, reference), f"rank {rank}: ring != Allreduce on integer data"

    # Random floats: a different summation order may change the last bits, so compare closely.
    x = np.random.default_rng(100 + rank).standard_normal(n)
    comm.Barrier()
    t0 = time.perf_counter()
    mine = ring_allreduce(comm, x)
    t1 = time.perf_counter()
    reference = np.empty(n)
    comm.Allreduce(x, reference, op=MPI.SUM)
    t2 = time.perf_counter()
    assert np.allclose(mine, reference, rtol=1e-12, atol=1e-12 * size), f"rank {rank}: ring != Allreduce"
    ok = comm.allreduce(1, op=MPI.SUM)  # reached only if every rank's asserts passed
    if rank == 0:
        assert ok == size
        print(f"ring_allreduce: {size} ranks, n={n}, chunks of {n // size}..{-(-n // size)} elements")
        print("  integer data: ring result == Allreduce result, bit for bit, on every rank")
        print(f"  float data:   max |ring - Allreduce| = {np.abs(mine - reference).max():.2e} on rank 0")
        print(f"  time on rank 0: ring {1e3 * (t1 - t0):.2f} ms, MPI Allreduce {1e3 * (t2 - t1):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
