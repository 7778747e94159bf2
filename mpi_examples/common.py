"""The two helpers every example imports: abort the whole job on an error, and check argv.

Why they exist:

* An uncaught exception ends only the rank that raised it. Its peers sit forever in their next
  Recv or collective, and mpiexec waits for them (measured: the job hangs until killed).
  ``abort_on_exception()`` replaces ``sys.excepthook`` with one that prints the traceback and
  calls ``MPI.COMM_WORLD.Abort(1)``, which tells mpiexec to kill every rank: the job ends at once
  with a non-zero exit code. ``python -m mpi4py script.py`` does the same thing; we do it in the
  script so that plain ``mpiexec -n 4 python script.py`` is safe too.
* Bad input is not an exception: rank 0 parses argv, broadcasts its verdict, and then EVERY rank
  takes the same branch, so rank 0 prints one clear line and all ranks ``sys.exit(2)`` together.
  Nobody is left waiting, so no Abort is needed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from mpi4py import MPI

PROG = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "mpi_example"


def abort_on_exception(comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """After this, an exception (a failed assert included) on ANY rank ends the WHOLE job."""

    def hook(exc_type, exc, tb):
        sys.stdout.flush()
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[rank {comm.Get_rank()}] {text}")  # one write: lines are not interleaved
        sys.stderr.flush()
        # mpiexec forwards our stderr asynchronously and drops what is in flight when it kills
        # the job; half a second lets the traceback reach the terminal first.
        time.sleep(0.5)
        comm.Abort(1)  # never returns: mpiexec kills every rank

    sys.excepthook = hook


def fail_everywhere(message: str | None, comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """Collective: if rank 0's ``message`` is not None, rank 0 prints it and every rank exits 2."""
    message = comm.bcast(message, root=0)
    if message is not None:
        if comm.Get_rank() == 0:
            print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def positive_int_arg(index: int, name: str, default: int, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    """Collective: rank 0 reads ``sys.argv[index]`` (or ``default``), checks it is an integer >= 1,
    and broadcasts it; on bad input every rank exits 2 after rank 0 says why, in one line."""
    value, message = default, None
    if comm.Get_rank() == 0 and len(sys.argv) > index:
        text = sys.argv[index]
        try:  # "1000000" or "1e6" (digits around one 'e'); "1.5", "abc", "-3" go to the checks
            value = int(float(text)) if text.lower().replace("e", "").isdigit() else int(text)
        except ValueError:
            message = f"{name}='{text}' is not an integer; pass a whole number >= 1, e.g. {default}"
        else:
            if value < 1:
                message = f"{name}={value} must be >= 1; pass a whole number >= 1, e.g. {default}"
    fail_everywhere(message, comm)
    return comm.bcast(value, root=0)
