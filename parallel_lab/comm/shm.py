"""Shared-memory transport for the hand-written ring when every rank runs on one host.

What it is for: gloo moves every byte of a send/recv through loopback TCP (the kernel copies it into
a socket buffer and out again, and each message waits for the peer's receive-ready notice, ~100-200
us). Ranks on one host can instead hand bytes over through memory they both map, the way MPICH's
nemesis channel and NCCL's intra-node SHM transport do. The algorithms stay the hand-written ones
of ``collectives.py``; only the link under the ring changes.

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
``available()`` refuses anything but x86-64 and the ring stays on gloo there.

Lifetime: each rank creates its file under ``/dev/shm`` (tmpfs), maps it, a barrier, maps its
right neighbour's file, a barrier, then unlinks its own file at once: the mappings outlive the name,
so nothing is left in ``/dev/shm`` even if a rank is killed later (only a kill inside setup's two
barriers could leave one file). Pages are allocated up front (``posix_fallocate``) so a full tmpfs
fails at setup (fall back to gloo) rather than with SIGBUS mid-collective.

Waiting: a few checks back to back, then ``os.sched_yield()`` (which also releases the GIL: in
``manual_ddp`` the waiting thread is the communication thread and backward runs beside it), then
sleeps growing to ``MAX_SLEEP_S`` so a rank waiting for a slow peer does not take the CPU its peer
needs (2 ranks on 2 cores). A wait gives up after ``timeout_s()`` (``PARALLEL_LAB_SHM_TIMEOUT_S``,
else the process group's own timeout, the run's ``dist_timeout_s``) with a RuntimeError naming
the peer, and sooner if the peer process is gone (checked
every ``LIVENESS_S`` when the ranks share a pid namespace).

Choice of transport, made in one place (``transport()``): ``PARALLEL_LAB_HAND_TRANSPORT`` =
``auto`` (default: shm when every rank of the default group is on this host — same hostname and
boot id, exchanged once — on x86-64, CPU tensors, and every rank could create and map its file;
gloo's isend/irecv otherwise), ``shm`` (the same, but an error instead of the fall-back) or ``p2p``
(always gloo). Every rank must see the same value. Like the p2p ring, one thread at a time may
run the collectives (manual_ddp: its single communication thread).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

TRANSPORT_ENV = "PARALLEL_LAB_HAND_TRANSPORT"
TRANSPORTS = ("auto", "shm", "p2p")
TIMEOUT_ENV = "PARALLEL_LAB_SHM_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
SHM_DIR = "/dev/shm"
PREFIX = "parallel_lab_shm_"  # every file this module creates starts with it (tests look for leftovers)
SLOTS = 4
# Slot size: a message (ring segment) is at most one slot. 1 MiB amortises the ~10-20 us of Python
# per message; 4 slots keep 4 MiB in flight per link (measured: bench collectives, docs/benchmarks.md).
SLOT_BYTES = 1 << 20
X86 = ("x86_64", "amd64", "i386", "i686", "x86")

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


def timeout_s() -> float:
    """How long a wait on a peer may last: PARALLEL_LAB_SHM_TIMEOUT_S, else the default process
    group's own timeout (the run's ``dist_timeout_s``: a stuck peer fails the ring when it would
    have failed a gloo collective), else DEFAULT_TIMEOUT_S."""
    if TIMEOUT_ENV in os.environ:
        return float(os.environ[TIMEOUT_ENV])
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # no default group yet, or a backend without options
        return DEFAULT_TIMEOUT_S


def requested() -> str:
    choice = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if choice not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={choice!r} is unknown; use one of {TRANSPORTS}")
    return choice


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


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


# ---- setup: once per default process group, on every rank ----------------------------------------
_cache: dict = {"group": None, "link": None, "why": None}


def transport(device: torch.device | None = None) -> Link | None:
    """The shm link for the default group, or None for gloo's isend/irecv (the one place that decides).

    Collective on first use per default group: every rank must call it at the same point (the
    hand-written collectives do, before their first message)."""
    choice = requested()
    if choice == "p2p" or dist.get_world_size() < 2:
        return None
    if device is not None and device.type != "cpu":
        if choice == "shm":
            raise RuntimeError(f"{TRANSPORT_ENV}=shm moves host memory, but the tensor is on {device}")
        return None
    group = dist.group.WORLD
    if _cache["group"] is not group:
        _cache["group"] = group
        _cache["link"], _cache["why"] = _setup()
    link = _cache["link"]
    if link is None and choice == "shm":
        raise RuntimeError(f"{TRANSPORT_ENV}=shm, but the shm transport cannot be used: {_cache['why']}")
    if link is not None:
        link.check()
    return link


def describe() -> str:
    """Which transport the hand-written ring uses now, and why (for the benchmark's header)."""
    if requested() == "p2p":
        return f"p2p (gloo isend/irecv; {TRANSPORT_ENV}=p2p)"
    if _cache["link"] is not None:
        return f"shm ({SHM_DIR}, {SLOTS} x {SLOT_BYTES >> 10} KiB slots per ring link)"
    if _cache["why"] is not None:
        return f"p2p (gloo isend/irecv; shm not usable: {_cache['why']})"
    return f"{requested()} (not set up yet)"


def reset() -> None:
    """Forget the link (its mappings go when nothing references them); the next call sets up again."""
    _cache.update(group=None, link=None, why=None)


def _local_reason() -> str | None:
    """Why this rank cannot use shm at all, or None."""
    if platform.machine().lower() not in X86:
        return f"{platform.machine()} is not x86-64, whose store ordering the transport relies on"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


def _setup() -> tuple[Link | None, str | None]:
    """Create this rank's inbox, exchange identities, map the right neighbour's inbox, unlink.
    Every rank runs both exchanges whatever happens, so a rank that cannot use shm never leaves
    its peers waiting; all ranks then agree (shm everywhere or nowhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    size = _HEADER + SLOTS * SLOT_BYTES
    token = secrets.randbits(62)
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}_{token:x}")
    why, inbox_file, created = _local_reason(), None, False
    try:
        if why is None:
            try:
                inbox_file = _File(path, create=True, size=size)
                created = True
                inbox_file.q[_Q_RANK], inbox_file.q[_Q_TOKEN], inbox_file.q[_Q_MAGIC] = rank, token, _MAGIC
            except (OSError, ValueError) as err:
                why = f"rank {rank} could not create {path}: {err}"
                with contextlib.suppress(OSError):  # created but not mapped (e.g. tmpfs full)
                    os.unlink(path)
        me = {
            "host": socket.gethostname(),
            "boot": _boot_id(),
            "pidns": _pid_namespace(),
            "pid": os.getpid(),
            "path": path,
            "token": token,
            "why": why,
        }
        everyone: list = [None] * world
        dist.all_gather_object(everyone, me)  # barrier 1: every inbox exists (or we know why not)
        why = next((e["why"] for e in everyone if e["why"]), None)
        hosts = {(e["host"], e["boot"]) for e in everyone}
        if why is None and len(hosts) > 1:
            why = f"the ranks run on {len(hosts)} hosts"
        outbox_file = None
        if why is None:
            right = everyone[(rank + 1) % world]
            try:
                outbox_file = _File(right["path"], create=False, size=size)
                q = outbox_file.q
                if (q[_Q_MAGIC], q[_Q_RANK], q[_Q_TOKEN]) != (_MAGIC, (rank + 1) % world, right["token"]):
                    raise ValueError("its header is not the right neighbour's (another /dev/shm?)")
            except (OSError, ValueError) as err:
                why = f"rank {rank} could not map {right['path']}: {err}"
        reasons: list = [None] * world
        dist.all_gather_object(reasons, why)  # barrier 2: every rank mapped its right neighbour's inbox
    finally:
        if created:
            os.unlink(path)  # the mappings stay; the name goes
    why = next((r for r in reasons if r), None)
    if why is not None:
        return None, why
    pids = [e["pid"] if e["pidns"] and e["pidns"] == me["pidns"] else None for e in everyone]
    return Link(rank, world, Inbox(inbox_file), Outbox(outbox_file), pids, timeout_s()), None
