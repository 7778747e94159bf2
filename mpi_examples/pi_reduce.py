"""pi two ways, with the work split over ranks and the partial sums combined by Reduce.

    mpiexec -n 4 python mpi_examples/pi_reduce.py [n]      # n terms / intervals, default 10**6
    python mpi_examples/pi_reduce.py [n]                   # the same program on 1 rank

1. arctan(1) series (Leibniz): pi = 4 * sum_{k>=0} (-1)^k / (2k+1). Rank r sums the terms
   k = r, r+p, r+2p, ... (a cyclic split: every rank gets the same mix of big and small terms),
   then ``Reduce(SUM)`` adds the p partial sums on the root. Slow: error ~ 1/n.
2. Midpoint rule: pi = integral_0^1 4 / (1 + x^2) dx with n intervals. Only rank 0 "knows" n
   (it read argv); ``Bcast`` sends it to everyone (the buffer API: a 1-element numpy array),
   each rank sums its strided midpoints, ``Reduce(SUM)`` again. Fast: error ~ 1/n^2.
"""

import math
import sys

import numpy as np
from common import abort_on_exception, positive_int_arg
from mpi4py import MPI

BLOCK = 1 << 20  # indices per numpy step, so memory stays small even for n = 10**9


def strided_sum(term, start: int, step: int, n: int) -> float:
    """sum(term(k) for k in range(start, n, step)), vectorised block by block."""
    total = 0.0
    for lo in range(start, n, step * BLOCK):
        k = np.arange(lo, min(n, lo + step * BLOCK), step, dtype=np.float64)
        total += float(term(k).sum())
    return total


def series_term(k):
    return 4.0 * np.where(k % 2 == 0, 1.0, -1.0) / (2.0 * k + 1.0)


def main() -> int:
    abort_on_exception()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n_arg = positive_int_arg(1, "n", 10**6)  # validated on rank 0; bad input exits every rank

    # 1. series: every rank already has n_arg (positive_int_arg broadcast it as a Python object).
    partial = np.array([strided_sum(series_term, rank, size, n_arg)])
    series = np.zeros(1)
    comm.Reduce(partial, series, op=MPI.SUM, root=0)  # only the root's `series` is filled

    # 2. midpoint rule: the classic "root owns n, Bcast it" pattern, with the buffer API.
    n = np.array([n_arg if rank == 0 else 0], dtype=np.int64)
    comm.Bcast(n, root=0)
    h = 1.0 / int(n[0])
    partial = np.array([h * strided_sum(lambda k: 4.0 / (1.0 + ((k + 0.5) * h) ** 2), rank, size, int(n[0]))])
    integral = np.zeros(1)
    comm.Reduce(partial, integral, op=MPI.SUM, root=0)

    if rank == 0:
        s_err, i_err = abs(series[0] - math.pi), abs(integral[0] - math.pi)
        print(f"pi_reduce: n={n_arg} ranks={size}")
        print(f"series   (Reduce SUM)           pi ~ {series[0]:.15f}  error {s_err:.3e}")
        print(f"integral (Bcast n + Reduce SUM) pi ~ {integral[0]:.15f}  error {i_err:.3e}")
        # Alternating series: the error after n terms is at most the first term left out.
        assert s_err <= 4.0 / (2 * n_arg + 1), f"series error {s_err} above its bound"
        # Midpoint rule: |error| <= max|f''| / 24 * h^2 with max|f''| = 8 on [0, 1] (+ rounding).
        assert i_err <= 8.0 / 24.0 * h * h + 1e-12, f"integral error {i_err} above its bound"
    return 0


if __name__ == "__main__":
    sys.exit(main())
