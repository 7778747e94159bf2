"""Point-to-point messages: blocking Send/Recv, tags, non-blocking Isend/Irecv + Wait, and the
lowercase (pickle) API beside the uppercase (buffer) API.

    mpiexec -n 4 python mpi_examples/send_recv.py [n]   # n float64 in the timed message, default 2**20
    python mpi_examples/send_recv.py [n]                # 1 rank: only the ring part (to itself)

mpi4py has two spellings of every call:
* lowercase ``comm.send(obj)`` / ``obj = comm.recv()``: any Python object, pickled into a fresh
  byte string, sent, then unpickled into a NEW object. Convenient, but it copies twice and
  allocates on every message.
* Uppercase ``comm.Send(array)`` / ``comm.Recv(array)``: a buffer (numpy array) whose memory MPI
  reads or writes directly. No pickling, no copies, no allocation: the fast path, and what
  collectives on big tensors (gradients) use.
"""

import sys
import time

import numpy as np
from common import abort_on_exception, positive_int_arg
from mpi4py import MPI


def blocking_pair(comm) -> None:
    """Rank 0 -> rank 1 with Send/Recv; the Status tells the receiver who sent what."""
    rank = comm.Get_rank()
    if rank == 0:
        comm.Send(np.arange(5, dtype=np.float64), dest=1, tag=7)
    elif rank == 1:
        buf, status = np.empty(5), MPI.Status()
        comm.Recv(buf, source=MPI.ANY_SOURCE, tag=7, status=status)
        assert status.Get_source() == 0 and status.Get_tag() == 7
        assert status.Get_count(MPI.DOUBLE) == 5 and np.array_equal(buf, np.arange(5))


def tags_out_of_order(comm) -> None:
    """Tags let the receiver pick WHICH message it takes: rank 0 sends tag 1 then tag 2, rank 1
    receives tag 2 first. The sends are non-blocking, so rank 0 cannot deadlock waiting for
    rank 1 to take tag 1 first (a blocking Send of a big message may wait for its Recv)."""
    rank = comm.Get_rank()
    if rank == 0:
        reqs = [comm.Isend(np.full(3, float(tag)), dest=1, tag=tag) for tag in (1, 2)]
        MPI.Request.Waitall(reqs)
    elif rank == 1:
        second, first = np.empty(3), np.empty(3)
        comm.Recv(second, source=0, tag=2)
        comm.Recv(first, source=0, tag=1)
        assert (second == 2.0).all() and (first == 1.0).all()


def ring_shift(comm) -> np.ndarray:
    """Everyone sends to the right and receives from the left at the same time. With blocking
    Send on every rank this can deadlock (all ranks sending, nobody receiving); posting Irecv and
    Isend first and then Waiting on both cannot. Works on 1 rank too (a message to itself)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    outgoing, incoming = np.full(4, float(rank)), np.empty(4)
    recv_req = comm.Irecv(incoming, source=left, tag=3)
    send_req = comm.Isend(outgoing, dest=right, tag=3)
    # ... a real program would compute here while the message travels ...
    send_req.Wait()
    recv_req.Wait()
    assert (incoming == float(left)).all(), f"rank {rank} got {incoming} from rank {left}"
    return incoming


def ping_pong_seconds(comm, payload: np.ndarray, pickled: bool, reps: int) -> float:
    """Mean one-way time of rank 0 <-> rank 1 round trips, with either API."""
    rank = comm.Get_rank()
    other = np.empty_like(payload)
    comm.Barrier()
    start = time.perf_counter()
    for rep in range(reps + 1):
        if rep == 1:  # round trip 0 was the warm-up (first-touch of buffers, connection setup)
            start = time.perf_counter()
        if rank == 0:
            if pickled:
                comm.send(payload, dest=1)
                other = comm.recv(source=1)  # a NEW array each time: unpickled
            else:
                comm.Send(payload, dest=1)
                comm.Recv(other, source=1)  # written in place
        elif rank == 1:
            if pickled:
                other = comm.recv(source=0)
                comm.send(other, dest=0)
            else:
                comm.Recv(other, source=0)
                comm.Send(other, dest=0)
    elapsed = time.perf_counter() - start
    if rank == 0:
        assert np.array_equal(other, payload), "ping-pong payload came back changed"
    return elapsed / (2 * reps)


def main() -> int:
    abort_on_exception()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = positive_int_arg(1, "n", 1 << 20)

    ring = ring_shift(comm)
    if size == 1:
        if rank == 0:
            print(
                f"send_recv: 1 rank: Isend/Irecv to itself got {ring[0]:.0f}; Send/Recv, tags and the"
                " ping-pong timing need 2 ranks (mpiexec -n 2 ...)"
            )
        return 0
    blocking_pair(comm)
    tags_out_of_order(comm)

    payload = np.random.default_rng(0).random(n)
    reps = max(3, min(100, (64 << 20) // payload.nbytes))
    buffer_s = ping_pong_seconds(comm, payload, pickled=False, reps=reps)
    pickle_s = ping_pong_seconds(comm, payload, pickled=True, reps=reps)
    # Every rank checked its own part with asserts; one Allreduce tells rank 0 they all got here.
    ok = comm.allreduce(1, op=MPI.SUM)
    if rank == 0:
        assert ok == size
        print(f"send_recv: {size} ranks: Send/Recv with Status, tags received out of order, Isend/Irecv ring: ok")
        print(f"one-way time of a {payload.nbytes} B float64 message, rank 0 <-> 1, mean of {reps} round trips:")
        print(f"  buffer API  Send/Recv : {buffer_s * 1e3:9.3f} ms  ({payload.nbytes / buffer_s / 1e9:6.2f} GB/s)")
        print(
            f"  pickle API  send/recv : {pickle_s * 1e3:9.3f} ms  ({payload.nbytes / pickle_s / 1e9:6.2f} GB/s)"
            f"  = {pickle_s / buffer_s:.1f}x the buffer API time"
        )
        print(
            "  (big messages: pickling copies and allocates each one, so the buffer API wins; tiny ones:"
            " both are latency-bound; numbers are noisy when ranks share cores)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
