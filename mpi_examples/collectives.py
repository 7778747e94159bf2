"""Every collective once, on tiny integer-valued arrays, each checked against what it must give.

    mpiexec -n 4 python mpi_examples/collectives.py [total]   # total elements Scatter splits,
    python mpi_examples/collectives.py [total]                # default 4 per rank; must divide

A collective is called by EVERY rank of the communicator (the same call, in the same order);
"root" marks the rank that owns the input (Bcast, Scatter) or the output (Gather, Reduce).
Rank r's input below is x_r = [r*k + 1, ..., r*k + k] (k elements), so every result has a closed
form we can assert. Values are small integers stored as float64: sums and products are exact.
"""

import sys

import numpy as np
from common import abort_on_exception, fail_everywhere, positive_int_arg
from mpi4py import MPI

ROOT = 0


def show(comm, name: str, local: np.ndarray | None) -> None:
    """Print what every rank holds after `name` (gathered to rank 0 with the pickle API)."""
    held = comm.gather(None if local is None else local.tolist(), root=ROOT)
    if comm.Get_rank() == ROOT:
        cells = "  ".join(f"r{r}={v}" for r, v in enumerate(held) if v is not None)
        print(f"{name:<22} {cells}")


def main() -> int:
    abort_on_exception()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    total = positive_int_arg(1, "total", 4 * size)
    fail_everywhere(  # rank 0 decides; every rank exits 2 if Scatter cannot split evenly
        None
        if rank != ROOT or total % size == 0
        else f"total={total} elements cannot be Scattered evenly over {size} ranks; "
        f"pass a multiple of {size}, e.g. {4 * size}"
    )
    k = total // size
    everyone = np.arange(1, size * k + 1, dtype=np.float64).reshape(size, k)  # row r = x_r
    x = everyone[rank].copy()

    # Bcast: root's array overwrites everyone's.
    b = x.copy()
    comm.Bcast(b, root=ROOT)
    assert np.array_equal(b, everyone[ROOT])
    show(comm, "Bcast", b)

    # Scatter: root's array of size*k is cut into size pieces; piece r goes to rank r.
    send = everyone.ravel().copy() if rank == ROOT else None
    piece = np.empty(k)
    comm.Scatter(send, piece, root=ROOT)
    assert np.array_equal(piece, everyone[rank])
    show(comm, "Scatter", piece)

    # Gather: the reverse; only the root receives (size, k).
    gathered = np.empty((size, k)) if rank == ROOT else None
    comm.Gather(x, gathered, root=ROOT)
    if rank == ROOT:
        assert np.array_equal(gathered, everyone)
    show(comm, "Gather", None if gathered is None else gathered.ravel())

    # Allgather: Gather, but everybody gets the result.
    allg = np.empty((size, k))
    comm.Allgather(x, allg)
    assert np.array_equal(allg, everyone)
    show(comm, "Allgather", allg.ravel())

    # Reduce: element-wise combine over ranks, result on the root only.
    for name, op, expected in (
        ("SUM", MPI.SUM, everyone.sum(0)),
        ("PROD", MPI.PROD, everyone.prod(0)),
        ("MAX", MPI.MAX, everyone.max(0)),
        ("MIN", MPI.MIN, everyone.min(0)),
    ):
        out = np.empty(k) if rank == ROOT else None
        comm.Reduce(x, out, op=op, root=ROOT)
        if rank == ROOT:
            assert np.array_equal(out, expected), f"Reduce {name}: {out} != {expected}"
        show(comm, f"Reduce {name}", out)

    # Allreduce: Reduce + Bcast in one call; the gradient average of data parallelism.
    allr = np.empty(k)
    comm.Allreduce(x, allr, op=MPI.SUM)
    assert np.array_equal(allr, everyone.sum(0))
    show(comm, "Allreduce SUM", allr)

    # Reduce_scatter: Allreduce, but rank r keeps only block r of the sum (ZeRO's gradient step).
    # Each rank contributes a (size*k) vector: here row-major copies of `everyone` times (rank+1).
    contrib = everyone.ravel() * (rank + 1)
    block = np.empty(k)
    comm.Reduce_scatter(contrib, block, recvcounts=[k] * size, op=MPI.SUM)
    assert np.array_equal(block, everyone[rank] * sum(range(1, size + 1)))
    show(comm, "Reduce_scatter SUM", block)

    # Alltoall: rank r's block j goes to rank j's slot r (a distributed transpose).
    sendbuf = (100 * rank + np.arange(size * k, dtype=np.float64)).reshape(size, k)
    recvbuf = np.empty((size, k))
    comm.Alltoall(sendbuf, recvbuf)
    for src in range(size):
        assert np.array_equal(recvbuf[src], 100 * src + np.arange(rank * k, (rank + 1) * k))
    show(comm, "Alltoall", recvbuf.ravel())

    # Barrier: nobody leaves until everybody arrived. No data; it only orders time.
    comm.Barrier()
    if rank == ROOT:
        print(f"collectives: {size} ranks, k={k} per rank: every result matches its closed form")
    return 0


if __name__ == "__main__":
    sys.exit(main())
