"""The shm ring link: the inbox a rank reads, the outbox it writes, and how a wait on a peer backs off.

``comm/shm.py`` decides whether the hand-written ring uses shared memory and sets the link up, once
per default process group; this module is what every message does once it is set up.

Layout. Each rank owns one file, its *inbox*: what its left neighbour sends it. It holds

- a header line (magic, owner rank, a random token, so a peer can check it mapped the right file);
- two int64 sequence counters, each on its own 128-byte line (two cache lines: the adjacent-line
  prefetcher would otherwise make the two writers fight over one pair): ``written`` (messages the
  sender has published; only the sender writes it) and ``consumed`` (messages the receiver has
  finished reading; only the receiver writes it);
- the byte length of the message in each slot (a guard against ranks calling with different sizes);
- ``SLOTS`` slots of ``SLOT_BYTES``: message ``m`` goes into slot ``m % SLOTS``, so the sender may run
  up to ``SLOTS`` messages ahead of the receiver (pipelining: the receiver adds one slot while the
  sender fills the next).

Send (``Outbox.send``): wait until ``written - consumed < SLOTS`` (a free slot), copy the message
into the slot, store its length, *then* store ``written + 1``. Receive (``Inbox``): wait until
``written`` passes the messages already read, add or copy straight out of the slot (no scratch
buffer, unlike gloo's receive), then store ``consumed + 1``. The counters only grow and persist across
calls: consecutive collectives form one stream of messages per link.

Memory-ordering assumption (why the fall-back off x86): x86-64 is TSO (total store order): a core's
stores become visible to other cores in program order, loads are not reordered with older loads,
and aligned 8-byte loads and stores are atomic; multi-copy atomicity carries this through torch's
worker threads (they finish their part of a copy before the calling thread goes on). So a receiver
that sees the new ``written`` also sees the slot's bytes, and a sender that sees ``consumed`` may
overwrite the slot. glibc's memcpy switches to non-temporal stores for big copies, which are *not*
ordered by TSO, but it ends them with ``sfence``. The counters are read and written through a
``memoryview`` cast to int64 (one aligned 8-byte ``mov`` each) and Python does not reorder statements.
On a weakly ordered CPU (ARM, POWER) this would need fences that Python cannot issue, so
``comm/shm.py`` refuses anything but x86-64 and the ring stays on gloo there.

Waiting: a few checks back to back, then ``os.sched_yield()`` (which also releases the GIL: in
``manual_ddp`` the waiting thread is the communication thread and backward runs beside it), then
sleeps growing to ``MAX_SLEEP_S`` so a rank waiting for a slow peer does not take the CPU its peer
needs (2 ranks on 2 cores). A wait gives up after ``shm.timeout_s()`` (``PARALLEL_LAB_SHM_TIMEOUT_S``,
else the process group's own timeout, the run's ``dist_timeout_s``) with a RuntimeError naming
the peer, and sooner if the peer process is gone (checked
every ``LIVENESS_S`` when the ranks share a pid namespace).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import torch

TIMEOUT_ENV = "PARALLEL_LAB_SHM_TIMEOUT_S"
SLOTS = 4
# Slot size: a message (ring segment) is at most one slot. 1 MiB amortises the ~10-20 us of Python
# per message; 4 slots keep 4 MiB in flight per link (measured: bench collectives, docs/benchmarks.md).
SLOT_BYTES = 1 << 20

_LINE = 128  # bytes between counters written by different processes (2 cache lines, see above)
_MAGIC = 0x6D68735F6C70  # "pl_shm"
_HEADER = 4096  # header + counters + lengths, one page; slots start page-aligned
# int64 indices into the header
_Q_MAGIC, _Q_RANK, _Q_TOKEN = 0, 1, 2
_Q_WRITTEN = _LINE // 8
_Q_CONSUMED = 2 * _LINE // 8
_Q_LENGTHS = 3 * _LINE // 8  # SLOTS int64 lengths

SPIN_CHECKS = 32  # checks back to back before yielding (a few us)
YIELD_CHECKS = 200  # then sched_yield()s (tens of us to a few ms, with other runnable processes)
MIN_SLEEP_S, MAX_SLEEP_S = 20e-6, 500e-6
LIVENESS_S = 0.05  # how often a long wait checks that the peer process still exists


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead rank its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class _File:
    """One rank's inbox file mapped into this process: the header as int64s, the slots as bytes."""

    def __init__(self, path: str, create: bool, size: int) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # tmpfs full: ENOSPC now, not SIGBUS later
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"{path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self.q = memoryview(self.mm)[:_HEADER].cast("q")
        data = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.slots = [data[_HEADER + k * SLOT_BYTES : _HEADER + (k + 1) * SLOT_BYTES] for k in range(SLOTS)]
        self._typed: dict[torch.dtype, list[torch.Tensor]] = {}

    def slot(self, k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot k's first ``numel`` elements as ``dtype`` (typed views cached per dtype)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = [s.view(dtype) for s in self.slots]
        return typed[k][:numel]


class PeerGone(RuntimeError):
    """A wait on a peer ran past the timeout, or the peer process exited."""


class _Wait:
    """Back-off for one wait on ``peer``: spin, then yield, then sleep; raise past the deadline."""

    __slots__ = ("link", "peer", "what", "checks", "sleep", "deadline", "next_liveness")

    def __init__(self, link: "Link", peer: int, what: str) -> None:
        self.link, self.peer, self.what = link, peer, what
        self.checks, self.sleep = 0, MIN_SLEEP_S
        now = time.monotonic()
        self.deadline, self.next_liveness = now + link.timeout_s, now + LIVENESS_S

    def pause(self) -> None:
        self.checks += 1
        if self.checks <= SPIN_CHECKS:
            return
        if self.checks <= SPIN_CHECKS + YIELD_CHECKS:
            os.sched_yield()  # releases the GIL too
        else:
            time.sleep(self.sleep)
            self.sleep = min(2 * self.sleep, MAX_SLEEP_S)
        now = time.monotonic()
        if now >= self.next_liveness:
            self.next_liveness = now + LIVENESS_S
            pid = self.link.pids[self.peer]
            if pid is not None and not _alive(pid):
                self.link.broken = f"rank {self.peer} (pid {pid}) exited"
                raise PeerGone(
                    f"shm transport: rank {self.peer} (pid {pid}) exited while rank {self.link.rank} waited "
                    f"for it to {self.what}"
                )
        if now >= self.deadline:
            self.link.broken = f"a wait on rank {self.peer} timed out"
            raise PeerGone(
                f"shm transport: rank {self.link.rank} waited {self.link.timeout_s:g} s for rank {self.peer} to "
                f"{self.what}; is rank {self.peer} alive and running the same collectives? "
                f"({TIMEOUT_ENV} sets the limit)"
            )


class Inbox:
    """This rank's end of the link from its left neighbour (the file this rank created)."""

    def __init__(self, file: _File) -> None:
        self.file, self.q = file, file.q
        self.received = 0  # messages read so far; == the consumed counter

    def ready(self) -> bool:
        return self.q[_Q_WRITTEN] > self.received

    def peek(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next message, read in place in its slot (only after ``ready()``)."""
        k = self.received % SLOTS
        view = self.file.slot(k, numel, dtype)
        if self.q[_Q_LENGTHS + k] != numel * view.element_size():
            raise RuntimeError(
                f"shm transport: expected a {numel * view.element_size()}-byte message, the left neighbour sent "
                f"{self.q[_Q_LENGTHS + k]} bytes: ranks called different collectives or sizes"
            )
        return view

    def release(self) -> None:
        """Done reading the slot: the sender may overwrite it."""
        self.received += 1
        self.q[_Q_CONSUMED] = self.received


class Outbox:
    """This rank's end of the link to its right neighbour (the file the right neighbour created)."""

    def __init__(self, file: _File) -> None:
        self.file, self.q = file, file.q
        self.sent = 0  # messages published so far; == the written counter

    def has_free_slot(self) -> bool:
        return self.sent - self.q[_Q_CONSUMED] < SLOTS

    def send(self, part: torch.Tensor) -> None:
        """Copy one message (at most ``SLOT_BYTES``) into the next slot and publish it; only after
        ``has_free_slot()``. The data first, the counter last: see the module docstring."""
        k = self.sent % SLOTS
        self.file.slot(k, part.numel(), part.dtype).copy_(part)
        self.q[_Q_LENGTHS + k] = part.numel() * part.element_size()
        self.sent += 1
        self.q[_Q_WRITTEN] = self.sent


@dataclass
class Link:
    """The shm ring link of this rank: receive from ``left``, send to ``right``."""

    rank: int
    world: int
    inbox: Inbox
    outbox: Outbox
    pids: list  # peers' pids, or None where liveness cannot be checked (another pid namespace)
    timeout_s: float
    broken: str | None = None

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.world

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def slot_bytes(self) -> int:
        return SLOT_BYTES

    def check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(
                f"shm transport on rank {self.rank} is unusable after an earlier failure ({self.broken}); "
                "restart the ranks"
            )

    def push(self, outgoing) -> None:
        """Send queued messages (a deque) while the right neighbour has free slots; never waits."""
        outbox = self.outbox
        while outgoing and outbox.has_free_slot():
            outbox.send(outgoing.popleft())

    def wait_inbox(self, outgoing) -> None:
        """Wait for the next message from the left, sending queued messages meanwhile (a rank
        must never block on its receive while holding sends its right neighbour waits for)."""
        self.push(outgoing)
        if self.inbox.ready():
            return
        wait = _Wait(self, self.left, "send its next message")
        while not self.inbox.ready():
            self.push(outgoing)
            wait.pause()

    def flush(self, outgoing) -> None:
        """Send everything still queued, waiting for free slots."""
        self.push(outgoing)
        if outgoing:
            wait = _Wait(self, self.right, "free a slot (read an earlier message)")
            while outgoing:
                wait.pause()
                self.push(outgoing)
