"""Distributed test bodies for the shared-memory transport (parallel_lab.comm.shm) under the
hand-written ring, run by tests/integration/test_shm.py on real gloo ranks of one host."""

from __future__ import annotations

import os
import sys
import time

import torch

from parallel_lab.comm import collectives, shm, shm_link

SLOT_ELEMS = shm.SLOT_BYTES // 4  # float32 elements per slot


def _sizes(world: int) -> tuple[int, ...]:
    # Tiny (empty ring chunks), not divisible by 2 or 3, and chunks of 2.5 slots (several messages
    # per chunk, more than the 4 slots in flight over the whole call).
    return (1, 7, 1001, int(2.5 * SLOT_ELEMS) * world + 1)


def _rank_input(numel: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible by any rank (so each can compute the reference locally)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=dtype)
    return torch.randint(-(10**6), 10**6, (numel,), generator=gen, dtype=dtype)


def _reference_sum(numel: int, dtype: torch.dtype, world: int, seed: int) -> torch.Tensor:
    """The sum of every rank's input, computed here without any communication (float64 for floats)."""
    if dtype.is_floating_point:
        return sum(_rank_input(numel, dtype, r, seed).double() for r in range(world)).to(dtype)
    return sum(_rank_input(numel, dtype, r, seed) for r in range(world))


def mismatch(ours: torch.Tensor, reference: torch.Tensor) -> str | None:
    """What is wrong with a result against the reference (ints exact; floats within rounding), or None."""
    if ours.dtype.is_floating_point:
        bad = ~torch.isclose(ours, reference, rtol=1e-5, atol=1e-5)
    else:
        bad = ours != reference
    count = int(bad.sum())
    return f"{count} of {ours.numel()} elements differ" if count else None


def _run(transport: str, fn, x: torch.Tensor) -> torch.Tensor:
    os.environ[shm.TRANSPORT_ENV] = transport
    try:
        out = x.clone()
        fn(out)
        return out
    finally:
        os.environ.pop(shm.TRANSPORT_ENV)


def _own(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return collectives.ring_chunks(t, world)[rank]


def _assert_no_file_of_mine() -> None:
    mine = [f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"{shm.PREFIX}{os.getpid()}_")]
    assert not mine, f"the inbox file should be unlinked once mapped: {mine}"


def check_against_p2p(rank: int, world_size: int) -> None:
    """all_reduce (sum and mean), reduce_scatter and all_gather over shm: equal to a reference
    computed here, and bit for bit equal to the gloo (p2p) path with the same arguments."""
    checked, seed = 0, 0
    for dtype in (torch.float32, torch.int64):
        for numel in _sizes(world_size):
            seed += 1
            x = _rank_input(numel, dtype, rank, seed)
            reference = _reference_sum(numel, dtype, world_size, seed)
            calls = {
                "all_reduce": (lambda t: collectives.all_reduce(t, op="sum", algorithm="ring"), lambda t: t),
                "all_reduce mean": (
                    lambda t: collectives.all_reduce(t, op="mean", algorithm="ring"),
                    lambda t: t,
                ),
                "reduce_scatter": (collectives.reduce_scatter, lambda t: _own(t, rank, world_size)),
            }
            for what, (fn, part) in calls.items():
                p2p, ours = _run("p2p", fn, x), _run("shm", fn, x)
                want = part(reference)
                if what == "all_reduce mean":
                    want = want / world_size if dtype.is_floating_point else want.div(world_size, rounding_mode="floor")
                wrong = mismatch(part(ours), want)
                assert wrong is None, f"shm {what} {dtype} numel={numel}: {wrong}"
                assert torch.equal(ours, p2p), f"shm {what} {dtype} numel={numel} differs from the p2p path"
                checked += 1
            contribution = torch.zeros_like(x)  # all_gather: each rank contributes its own chunk
            _own(contribution, rank, world_size).copy_(_own(x, rank, world_size))
            gathered = torch.cat([_own(_rank_input(numel, dtype, r, seed), r, world_size) for r in range(world_size)])
            p2p, ours = (
                _run("p2p", collectives.all_gather, contribution),
                _run("shm", collectives.all_gather, contribution),
            )
            assert torch.equal(ours, gathered), f"shm all_gather {dtype} numel={numel}"
            assert torch.equal(ours, p2p), f"shm all_gather {dtype} numel={numel} differs from the p2p path"
            checked += 1
    assert shm.transport() is not None, shm.describe()  # auto picked shm: every rank is on this host
    _assert_no_file_of_mine()
    print(f"checked {checked} over {shm.describe()}")


def _publish_before_data(self, part: torch.Tensor) -> None:
    """BROKEN Outbox.send: publishes the counter, then copies the data (the sleep stands for the
    window a reordered store would leave)."""
    k = self.sent % shm.SLOTS
    self.q[shm_link._Q_LENGTHS + k] = part.numel() * part.element_size()
    self.sent += 1
    self.q[shm_link._Q_WRITTEN] = self.sent
    time.sleep(0.002)
    self.file.slot(k, part.numel(), part.dtype).copy_(part)


BROKEN = {
    # Writes the counter before the data: the receiver reads what the slot held before.
    "publish_before_data": lambda: setattr(shm.Outbox, "send", _publish_before_data),
    # Never waits for the receiver to consume: the sender overwrites slots still unread.
    "skip_consumed_wait": lambda: setattr(shm.Outbox, "has_free_slot", lambda self: True),
}


def check_broken(rank: int, world_size: int, variant: str) -> None:
    """The correct transport passes the check; ``variant`` (a deliberately broken publish) must fail
    it. Prints ``correct: ok`` and then ``broken: <what the check found>``."""
    numel = 8 * SLOT_ELEMS * world_size  # every chunk 8 whole slots: more messages than slots
    x = _rank_input(numel, torch.float32, rank, seed=5)
    reference = _reference_sum(numel, torch.float32, world_size, seed=5)
    ours = _run("shm", lambda t: collectives.all_reduce(t, algorithm="ring"), x)
    print(f"correct: {mismatch(ours, reference) or 'ok'}")
    BROKEN[variant]()
    for seed in (6, 7):  # a second call, so slots hold stale data of the first one too
        x = _rank_input(numel, torch.float32, rank, seed)
        reference = _reference_sum(numel, torch.float32, world_size, seed)
        try:
            ours = _run("shm", lambda t: collectives.all_reduce(t, algorithm="ring"), x)
            found = mismatch(ours, reference)
        except RuntimeError as err:  # the length guard may notice first
            found = f"raised {err}"
        if found:
            break
    print(f"broken: {found or 'not detected'}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # the ranks' streams are out of step now: skip the final barrier


def check_dead_peer(rank: int, world_size: int, how: str) -> None:
    """The last rank stops in the middle of an all_reduce (``exit``: the process ends; ``stall``: it
    sleeps past the others' timeout); every other rank must raise instead of waiting forever."""
    numel = 4 * SLOT_ELEMS * world_size
    collectives.all_reduce(torch.ones(numel))  # set up (and check) the link first
    assert shm.transport() is not None, shm.describe()
    last = world_size - 1
    if rank == last:
        sent = []
        original = shm.Outbox.send

        def send_then_stop(self, part):
            original(self, part)
            sent.append(1)
            if len(sent) == 2:
                sys.stdout.flush()
                if how == "stall":
                    time.sleep(float(os.environ[shm.TIMEOUT_ENV]) + 0.5)
                os._exit(0)

        shm.Outbox.send = send_then_stop
    start = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(numel))
        print("no error", flush=True)
    except RuntimeError as err:
        print(f"raised after {time.monotonic() - start:.2f} s: {err}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # a peer is gone: skip the final barrier


def check_fallback(rank: int, world_size: int) -> None:
    """Ranks that look like two hosts (another hostname on the last rank) keep the gloo path under
    ``auto``, and ``shm`` refuses with the reason."""
    if rank == world_size - 1:
        shm.socket.gethostname = lambda: "another-host"
    x = torch.arange(10.0) + rank
    collectives.all_reduce(x)
    assert torch.equal(x, sum(torch.arange(10.0) + r for r in range(world_size)))
    assert shm.transport() is None and "hosts" in shm.describe(), shm.describe()
    os.environ[shm.TRANSPORT_ENV] = "shm"
    try:
        collectives.all_reduce(x)
        raise AssertionError("PARALLEL_LAB_HAND_TRANSPORT=shm across hosts should refuse")
    except RuntimeError as err:
        assert "hosts" in str(err), err
    print(f"fell back: {shm.describe()}")
