"""Collectives written by hand from point-to-point messages (``send``/``recv``/``isend``/``irecv``).

They teach what ``torch.distributed``'s collectives do inside, ``manual_ddp`` trains with them,
and the benchmarks (``python -m parallel_lab.bench allreduce|collectives``) time these very
functions. Every function works on the default process group, in place, on any shape, any number of
elements (divisible by the world size or not) and any dtype that supports ``+`` (float, int).
Reductions add in a fixed order, so float results are reproducible run to run and can differ from
the library's only by rounding (the order of the additions).

Costs below are for a tensor of B bytes on N ranks (per rank, per call):

=====================  =========================================  ===============================
function               pattern                                    bytes sent (busiest rank)
=====================  =========================================  ===============================
``broadcast``          binomial tree from ``src``                 <= B * ceil(log2 N)  (src)
``reduce``             star: everyone sends to ``dst``            B (leaf);  dst receives (N-1)B
``all_reduce`` star    reduce to rank 0, then rank 0 sends back   (N-1)B sent + (N-1)B received
                                                                  at rank 0: a hotspot
``all_reduce`` ring    reduce-scatter + all-gather over a ring    2(N-1)/N * B on every rank;
                       (over gloo, up to ``SMALL_BYTES`` on a     B * log2(N) with recursive
                       power-of-two world: recursive doubling)    doubling (log2 N steps)
``all_reduce`` builtin ``dist.all_reduce`` (gloo/nccl's own)      library's choice (ring-like)
``all_reduce`` mpi     mpi4py ``Allreduce`` on a numpy view       MPI library's choice, about
                       (``comm/mpi.py``; ranks from ``mpiexec``)  2(N-1)/N * B (Rabenseifner)
``reduce_scatter``     the ring's first half                      (N-1)/N * B on every rank
``all_gather``         the ring's second half                     (N-1)/N * B on every rank
=====================  =========================================  ===============================

The ring is bandwidth-optimal (Patarasuk & Yuan, JPDC 2009; the algorithm behind Baidu's ring
all-reduce and NCCL): busbw = algbw * 2(N-1)/N is the number that should stay flat as N grows.

Transport under the ring (``all_reduce`` ring, ``reduce_scatter``, ``all_gather``; the ring itself
is ``comm/ring.py``), chosen in one place, ``shm.transport()``:

- **shm** (default when every rank of the default group is on this host, x86-64, CPU tensors):
  ``comm/shm.py``, the way MPICH's nemesis and NCCL move bytes inside a node. Each ring link is a
  few slots of shared memory; a message is one copy into the right neighbour's slot, and the
  receiver adds (or copies) straight out of it: no socket, no kernel, no scratch buffer, a few
  microseconds per message. Same rounds, chunks and order of additions as over gloo, so the same
  bits (tests/integration/test_shm.py checks it). Latency is no longer per-message-bound, so the
  ring runs at every size (no recursive doubling).
- **p2p**: gloo's ``isend``/``irecv`` (loopback TCP on one host, the network across hosts); always
  used across hosts, or with ``PARALLEL_LAB_HAND_TRANSPORT=p2p``. Every gloo message costs a fixed
  ~100-200 us here (gloo's TCP pair sends only once the peer has announced the matching receive,
  then the peer's event loop wakes, a Work object completes), so ``all_reduce(ring)`` switches to
  recursive doubling below ``SMALL_BYTES`` on a power-of-two world (Thakur, Rabenseifner & Gropp,
  IJHPCA 2005: MPICH makes the same split), one message step per log2 N instead of the ring's
  2(N-1). On 2 ranks both give the same bits (one addition of two values commutes); on 4 or more,
  small tensors round differently from the shm ring's order (either is the same on every rank).

``broadcast``, ``reduce`` and ``all_reduce(star)`` always use gloo's send/recv. Measured side by
side with gloo and MPICH: ``python -m parallel_lab.bench collectives`` (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from parallel_lab.comm import ring
from parallel_lab.comm.algorithms import ALGORITHMS
from parallel_lab.comm.ring import RING_WINDOW, SEGMENT_BYTES, ring_chunks

OPS = ("sum", "mean")
# all_reduce(ring) over gloo (not shm) at or below this size runs recursive doubling instead. Measured at world 2
# (bench collectives, 7 rounds, 2 shared cores): recursive doubling takes 0.74-0.85x gloo's time
# from 1 KiB to 256 KiB; at 1 MiB it is 1.57x gloo's, but the ring was no better there (1.2x to
# 3.4x across runs): both pay gloo's per-message handshake, the ring twice in a row.
SMALL_BYTES = 1 << 20


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op={op!r} is unknown; use one of {OPS}")


def _finish_mean(tensor: torch.Tensor, op: str, world: int) -> None:
    """gloo has no MEAN/AVG for every call, so MEAN = SUM then divide (integers: floor)."""
    if op != "mean":
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(world)
    else:
        tensor.floor_divide_(world)


def _in_place(fn: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> torch.Tensor:
    """Run fn on a contiguous flat view; copy back if the caller's tensor was not contiguous."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    fn(flat)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy ``src``'s tensor to every rank, in place (binomial tree: ceil(log2 N) rounds).

    In round k every rank that already has the data (relative rank < 2^k) sends the whole
    tensor to relative rank + 2^k, so the number of holders doubles each round.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor

    def run(flat: torch.Tensor) -> None:
        rel = (rank - src) % world
        step = 1
        while step < world:
            if rel < step and rel + step < world:
                dist.send(flat, (rel + step + src) % world)
            elif step <= rel < 2 * step:
                dist.recv(flat, (rel - step + src) % world)
            step *= 2

    return _in_place(run, tensor)


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum") -> torch.Tensor:
    """Sum (or average) every rank's tensor into ``dst``'s tensor, in place (star pattern).

    Every other rank sends its whole tensor to ``dst`` (B bytes each); ``dst`` receives the
    N-1 tensors concurrently and adds them in rank order. Other ranks' tensors are unchanged.
    """
    _check_op(op)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        _finish_mean(tensor, op, world)
        return tensor

    def run(flat: torch.Tensor) -> None:
        if rank != dst:
            dist.send(flat, dst)
            return
        peers = [r for r in range(world) if r != dst]
        bufs = {r: torch.empty_like(flat) for r in peers}
        works = {r: dist.irecv(bufs[r], r) for r in peers}
        for r in peers:  # fixed order: the same float result on every run
            works[r].wait()
            flat.add_(bufs[r])
        _finish_mean(flat, op, world)

    return _in_place(run, tensor)


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "ring",
    segment_bytes: int | None = None,
    small_bytes: int | None = None,
) -> torch.Tensor:
    """Sum (or average) the tensor over all ranks, in place, with the chosen algorithm.

    ``star``: reduce to rank 0 then send the result back (rank 0 moves 2(N-1)B: a hotspot).
    ``ring``: chunked ring, 2(N-1) rounds, each rank sends 2(N-1)/N * B in total; chunks travel
    in pipelined segments of ``segment_bytes`` (default ``SEGMENT_BYTES``).
    ``builtin``: ``dist.all_reduce`` for comparison.
    ``mpi``: MPI's ``Allreduce`` on a zero-copy numpy view (``parallel_lab.comm.mpi``); only under
    ``mpiexec``, where MPI's ranks are the process group's.
    """
    _check_op(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {ALGORITHMS}")
    world = dist.get_world_size()
    if world == 1:
        _finish_mean(tensor, op, world)
        return tensor
    if algorithm == "builtin":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        _finish_mean(tensor, op, world)
        return tensor
    if algorithm == "mpi":
        from parallel_lab.comm import mpi

        _in_place(mpi.all_reduce_sum, tensor)
    elif algorithm == "star":
        _in_place(_star_all_reduce, tensor)
    # Recursive doubling only saves gloo's per-message cost; over shm a message costs microseconds,
    # so the ring (bandwidth-optimal at every size) runs there.
    elif ring.shm_link(tensor) is None and _latency_bound(
        tensor, world, SMALL_BYTES if small_bytes is None else small_bytes
    ):
        _in_place(lambda flat: _recursive_doubling(flat, segment_bytes or SEGMENT_BYTES), tensor)
    else:
        _in_place(lambda flat: _ring_all_reduce(flat, segment_bytes or SEGMENT_BYTES), tensor)
    _finish_mean(tensor, op, world)
    return tensor


def _latency_bound(tensor: torch.Tensor, world: int, small_bytes: int) -> bool:
    """Small tensors on a power-of-two world take recursive doubling rather than the ring.

    Both move the same bytes at N=2 (B per rank), but the ring needs 2(N-1) dependent message steps
    and recursive doubling log2(N): at N=2 one exchange instead of two. Each gloo message costs a
    fixed ~100 us here (a TCP write, the peer's epoll wake-up, a work object and its future), so
    below a few hundred KiB the step count, not the bytes, sets the time. Above it the ring wins:
    every rank adds only B/N elements instead of B*log2(N) (Thakur, Rabenseifner & Gropp,
    IJHPCA 2005, the same split MPICH makes). Non-power-of-two worlds keep the ring, which is
    already bit-identical on every rank without the extra fold steps.
    """
    return world & (world - 1) == 0 and tensor.numel() * tensor.element_size() <= small_bytes


def _recursive_doubling(flat: torch.Tensor, segment_bytes: int = SEGMENT_BYTES) -> None:
    """Recursive-doubling all-reduce (Thakur, Rabenseifner & Gropp 2005), N a power of two.

    Round k: exchange the whole partial sum with rank XOR 2^k and add it; after log2(N) rounds
    every rank holds the sum. The two partners add the same two values (IEEE addition commutes),
    so every rank ends with the same bits, as with the ring's all-gather copy. Each round's receives
    are posted before its sends, so gloo can write incoming bytes straight into the scratch tensor
    rather than buffer them; segments let the add of one overlap the transfer of the next.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    seg = max(1, segment_bytes // flat.element_size())
    parts, scratch = torch.split(flat, seg), torch.split(torch.empty_like(flat), seg)
    mask, base = 1, 0
    while mask < world:
        peer = rank ^ mask
        recvs = [dist.irecv(buf, peer, tag=base + k) for k, buf in enumerate(scratch)]
        sends = [dist.isend(part, peer, tag=base + k) for k, part in enumerate(parts)]
        for part, buf, recv, send in zip(parts, scratch, recvs, sends):
            recv.wait()
            send.wait()  # the add writes what this send reads
            part.add_(buf)
        mask, base = mask * 2, base + len(parts)


def _star_all_reduce(flat: torch.Tensor) -> None:
    """Gather-and-add at rank 0, then rank 0 sends the sum to every other rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reduce(flat, dst=0, op="sum")
    if rank == 0:
        works = [dist.isend(flat, r) for r in range(1, world)]
        for work in works:
            work.wait()
    else:
        dist.recv(flat, 0)


def _ring_all_reduce(flat: torch.Tensor, segment_bytes: int = SEGMENT_BYTES, window: int = RING_WINDOW) -> None:
    """Chunked ring all-reduce: reduce-scatter then all-gather, pipelined in segments.

    The tensor is cut into N chunks. Reduce-scatter: in round s (s = 0..N-2) rank r sends chunk
    (r - s) mod N to rank r+1 and adds the chunk (r - s - 1) mod N it receives from rank r-1;
    after N-1 rounds rank r owns the full sum of chunk (r + 1) mod N. All-gather: N-1 more rounds
    pass the finished chunks around the ring. Each round moves B/N bytes per rank, so each rank
    sends 2(N-1)/N * B in total, whatever N is.

    In both phases round t receives chunk (r - t - 1) mod N, and the next round sends exactly what
    was just received (after the add). So chunks travel in segments, each forwarded as soon as it
    is ready: the add of one segment overlaps the transfer of the next, and the all-gather starts
    while the reduce-scatter is still finishing (``ring.run``).
    """
    world = dist.get_world_size()
    ring.run(flat, dist.get_rank(), world - 1, world - 1, segment_bytes, window)


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", segment_bytes: int | None = None) -> torch.Tensor:
    """Ring reduce-scatter, in place: afterwards this rank's chunk of the flattened tensor
    (``ring_chunks(flat, N)[rank]``) holds the sum (or mean) of that chunk over all ranks; the other
    chunks hold partial sums. Each rank sends (N-1)/N * B: the first half of the ring all-reduce."""
    _check_op(op)
    rank, world = dist.get_rank(), dist.get_world_size()

    def run(flat: torch.Tensor) -> None:
        if world > 1:  # start one chunk back, so the chunk completed after N-1 rounds is this rank's own
            ring.run(flat, (rank - 1) % world, world - 1, 0, segment_bytes or SEGMENT_BYTES)
        _finish_mean(ring_chunks(flat, world)[rank], op, world)

    return _in_place(run, tensor)


def all_gather(tensor: torch.Tensor, segment_bytes: int | None = None) -> torch.Tensor:
    """Ring all-gather, in place: each rank's contribution is its chunk (``ring_chunks(tensor, N)[rank]``);
    afterwards every rank holds every chunk. Each rank sends (N-1)/N * B: the second half of the
    ring all-reduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1:
        _in_place(lambda flat: ring.run(flat, rank, 0, world - 1, segment_bytes or SEGMENT_BYTES), tensor)
    return tensor
