"""The segmented ring under ``collectives.all_reduce`` (ring), ``reduce_scatter`` and ``all_gather``.

One stream of messages around the ring, over gloo's ``isend``/``irecv`` or, when every rank is on
this host, over the shm link (``comm/shm.py`` decides which): the same rounds, chunks, segments and
additions either way, so the same bits. ``collectives.py`` says what each collective sends and costs.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from parallel_lab.comm import shm

SEGMENT_BYTES = 1 << 20  # ring pipelining granularity: big enough to amortise per-message cost
RING_WINDOW = 8  # ring receives posted ahead (and scratch segments held): 8 MiB at the default


def ring_chunks(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    """N nearly equal contiguous views (the first numel % N chunks are one element longer)."""
    return list(torch.tensor_split(flat, world))


def run(
    flat: torch.Tensor,
    owned: int,
    reduce_rounds: int,
    gather_rounds: int,
    segment_bytes: int = SEGMENT_BYTES,
    window: int = RING_WINDOW,
) -> None:
    """The segmented ring every ring collective runs: ``reduce_rounds`` rounds that add what they
    receive, then ``gather_rounds`` that copy it. Round 0 sends chunk ``owned``; round t receives
    chunk (owned - t - 1) mod N from the left neighbour and round t+1 forwards it to the right.

    All rounds form one stream of messages; receives are posted ``window`` messages ahead into a
    small pool of reused scratch segments (reducing rounds) or straight into the tensor (copying
    rounds). Every message has its own tag: gloo takes milliseconds to match a receive posted
    while another with the same peer and tag is pending.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    link = shm_link(flat)
    if link is not None:
        _over_shm(link, flat, owned, reduce_rounds, gather_rounds, segment_bytes)
        return
    right, left = (rank + 1) % world, (rank - 1) % world
    rounds = reduce_rounds + gather_rounds
    chunks = ring_chunks(flat, world)
    seg = max(1, min(segment_bytes // flat.element_size(), chunks[0].numel()))
    messages = stream(chunks, owned, rounds, seg)
    per_round = -(-chunks[0].numel() // seg)  # segments of the largest chunk: the same on every rank

    def tag(t: int, k: int) -> int:
        return t * per_round + k

    ahead = min(window, len(messages))  # receives posted ahead; reducing rounds need a scratch segment each
    pool = [torch.empty(seg, dtype=flat.dtype, device=flat.device) for _ in range(ahead if reduce_rounds else 0)]
    sends: dict[tuple[int, int], dist.Work] = {}  # (chunk, segment) -> in-flight send reading it

    def post(i: int) -> tuple[torch.Tensor, dist.Work]:
        t, chunk, k, part = messages[i]
        if t < reduce_rounds:  # reduce: receive beside the chunk, then add
            target = pool[i % ahead][: part.numel()]
        else:  # copy: receive straight into the chunk, once nothing still sends from it
            target = part
            earlier = sends.pop((chunk, k), None)
            if earlier is not None:
                earlier.wait()
        return target, dist.irecv(target, left, tag=tag(t, k))

    for k, part in enumerate(torch.split(chunks[owned], seg)):  # round 0 sends the owned chunk
        sends[(owned, k)] = dist.isend(part, right, tag=tag(0, k))
    posted = [post(i) for i in range(ahead)]
    for i, (t, chunk, k, part) in enumerate(messages):
        incoming, work = posted[i]
        work.wait()
        if t < reduce_rounds:
            part.add_(incoming)
        if t + 1 < rounds:  # forward to the right neighbour as round t+1's message
            sends[(chunk, k)] = dist.isend(part, right, tag=tag(t + 1, k))
        posted[i] = None
        if i + ahead < len(messages):
            posted.append(post(i + ahead))  # message i's pool slot is free again
    for work in sends.values():
        work.wait()


def stream(chunks: list[torch.Tensor], owned: int, rounds: int, seg: int) -> list:
    """(round, chunk index, segment index, segment view) for every message this rank receives, in
    order: round t receives chunk (owned - t - 1) mod N, cut into segments of ``seg`` elements."""
    world = len(chunks)
    stream = []
    for t in range(rounds):
        chunk = (owned - t - 1) % world
        stream += [(t, chunk, k, part) for k, part in enumerate(torch.split(chunks[chunk], seg))]
    return stream


def shm_link(flat: torch.Tensor):
    """The shm link under the ring when every rank is on this host (``comm/shm.py``), else None for
    gloo's isend/irecv: ``shm.transport`` is the one place that decides (``PARALLEL_LAB_HAND_TRANSPORT``)."""
    return shm.transport(flat.device)


def _over_shm(
    link: shm.Link, flat: torch.Tensor, owned: int, reduce_rounds: int, gather_rounds: int, segment_bytes: int
) -> None:
    """``run`` over shared memory: the same rounds, chunks, segments and additions (so the same
    bits as the gloo path), but a message is a copy into a slot of the right neighbour's inbox and a
    receive reads straight out of this rank's inbox: ``part.add_(slot)`` (reducing rounds) or
    ``part.copy_(slot)`` (copying rounds), with no scratch buffer. Sends are queued and go out
    whenever the right neighbour has a free slot, also while this rank waits for its left one.

    A copying round writes ``part`` only after everything queued before it went out: the chunk it
    receives last left this rank (as a queued send) N rounds earlier, and it can only come back after
    travelling the whole ring, i.e. after this rank's send of it was copied out."""
    rounds = reduce_rounds + gather_rounds
    chunks = ring_chunks(flat, link.world)
    seg = max(1, min(segment_bytes, link.slot_bytes) // flat.element_size())
    seg = min(seg, max(1, chunks[0].numel()))
    outgoing = deque(torch.split(chunks[owned], seg))  # round 0 sends the owned chunk
    inbox = link.inbox
    try:
        for t, _chunk, _k, part in stream(chunks, owned, rounds, seg):
            link.wait_inbox(outgoing)
            incoming = inbox.peek(part.numel(), part.dtype)
            if t < reduce_rounds:
                part.add_(incoming)  # the same order as run(): the local partial sum + the left's
            else:
                part.copy_(incoming)
            inbox.release()
            if t + 1 < rounds:  # forward to the right neighbour as round t+1's message
                outgoing.append(part)
        link.flush(outgoing)
    except BaseException as err:  # an interrupted call leaves the message streams out of step
        link.broken = link.broken or f"{type(err).__name__} in a collective"
        raise
