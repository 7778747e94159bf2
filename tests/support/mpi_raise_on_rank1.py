"""Helper for tests/integration/test_mpi.py (not a test): rank 1 raises while every other rank waits for it
forever (rank 0 in a Recv that never gets its message, the rest in a Barrier rank 1 never joins).

    mpiexec -n 2 python tests/support/mpi_raise_on_rank1.py            # hook on: the job must end at once
    mpiexec -n 2 python tests/support/mpi_raise_on_rank1.py --no-hook  # the control: this one hangs
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mpi_examples"))

import numpy as np
from common import abort_on_exception  # the hook every mpi_example installs
from mpi4py import MPI

if "--no-hook" not in sys.argv:
    abort_on_exception()
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    raise RuntimeError("boom on rank 1")
if comm.Get_rank() == 0:
    comm.Recv(np.empty(1), source=1)
comm.Barrier()
