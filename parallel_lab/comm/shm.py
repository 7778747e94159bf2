"""Shared-memory transport for the hand-written ring when every rank runs on one host.

What it is for: gloo moves every byte of a send/recv through loopback TCP (the kernel copies it into
a socket buffer and out again, and each message waits for the peer's receive-ready notice, ~100-200
us). Ranks on one host can instead hand bytes over through memory they both map, the way MPICH's
nemesis channel and NCCL's intra-node SHM transport do. The algorithms stay the hand-written ones
of ``collectives.py``; only the link under the ring changes.

Lifetime: each rank creates its file under ``/dev/shm`` (tmpfs), maps it, a barrier, maps its
right neighbour's file, a barrier, then unlinks its own file at once: the mappings outlive the name,
so nothing is left in ``/dev/shm`` even if a rank is killed later (only a kill inside setup's two
barriers could leave one file). Pages are allocated up front (``posix_fallocate``) so a full tmpfs
fails at setup (fall back to gloo) rather than with SIGBUS mid-collective.

Choice of transport, made in one place (``transport()``): ``PARALLEL_LAB_HAND_TRANSPORT`` =
``auto`` (default: shm when every rank of the default group is on this host — same hostname and
boot id, exchanged once — on x86-64, CPU tensors, and every rank could create and map its file;
gloo's isend/irecv otherwise), ``shm`` (the same, but an error instead of the fall-back) or ``p2p``
(always gloo). Every rank must see the same value. Like the p2p ring, one thread at a time may
run the collectives (manual_ddp: its single communication thread).

The link itself (the inbox and outbox layout, why x86-64's store order makes it safe, how a wait
backs off): ``comm/shm_link.py``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import socket

import torch
import torch.distributed as dist

from parallel_lab.comm.shm_link import (
    _HEADER,
    _MAGIC,
    _Q_MAGIC,
    _Q_RANK,
    _Q_TOKEN,
    SLOT_BYTES,
    SLOTS,
    TIMEOUT_ENV,
    Inbox,
    Link,
    Outbox,
    _File,
)

TRANSPORT_ENV = "PARALLEL_LAB_HAND_TRANSPORT"
TRANSPORTS = ("auto", "shm", "p2p")
DEFAULT_TIMEOUT_S = 300.0
SHM_DIR = "/dev/shm"
PREFIX = "parallel_lab_shm_"  # every file this module creates starts with it (tests look for leftovers)
X86 = ("x86_64", "amd64", "i386", "i686", "x86")


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


# ---- setup: once per default process group, on every rank ----------------------------------------
# The module's one piece of state (allowed in tests/unit/test_module_state.py): the link set up for
# the current default group, or why there is none. A new default group sets up again.
_links: dict = {"group": None, "link": None, "why": None}


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
    if _links["group"] is not group:
        _links["group"] = group
        _links["link"], _links["why"] = _setup()
    link = _links["link"]
    if link is None and choice == "shm":
        raise RuntimeError(f"{TRANSPORT_ENV}=shm, but the shm transport cannot be used: {_links['why']}")
    if link is not None:
        link.check()
    return link


def describe() -> str:
    """Which transport the hand-written ring uses now, and why (for the benchmark's header)."""
    if requested() == "p2p":
        return f"p2p (gloo isend/irecv; {TRANSPORT_ENV}=p2p)"
    if _links["link"] is not None:
        return f"shm ({SHM_DIR}, {SLOTS} x {SLOT_BYTES >> 10} KiB slots per ring link)"
    if _links["why"] is not None:
        return f"p2p (gloo isend/irecv; shm not usable: {_links['why']})"
    return f"{requested()} (not set up yet)"


def reset() -> None:
    """Forget the link (its mappings go when nothing references them); the next call sets up again."""
    _links.update(group=None, link=None, why=None)


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
