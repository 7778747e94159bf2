"""Distributed test bodies for parallel_lab.comm.collectives: each hand-written collective against
torch.distributed's own result, on real gloo ranks (run by tests/integration/test_collectives.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_lab.comm import collectives, shm

# Sizes chosen so most are not divisible by 2 or 3 (and 1 < world size: empty ring chunks).
SIZES = (1, 2, 5, 7, 1001, 40003)
SHAPES = ((3, 5, 7),)  # a multi-dimensional tensor and a non-contiguous one are checked too


def _rank_tensor(numel: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    """Different data on every rank, reproducible by any rank."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=dtype)
    return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)


def _assert_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, what
    if ours.dtype.is_floating_point:
        # Only the order of the float additions may differ from gloo's.
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=what)
    else:
        assert torch.equal(ours, theirs), what


# (algorithm, segment_bytes, small_bytes) for all_reduce; see check_all.
ALL_REDUCE_VARIANTS = (
    ("star", None, None),
    ("ring", None, None),
    ("ring", None, 0),
    ("ring", 40, 0),
    ("ring", 40, None),
    ("builtin", None, None),
)


def _assert_same_on_every_rank(ours: torch.Tensor, world: int, what: str) -> None:
    """Data parallelism needs the same bits on every rank (replicas would drift apart otherwise),
    which a tolerance against gloo's result would not show."""
    everyone = [torch.empty_like(ours) for _ in range(world)]
    dist.all_gather(everyone, ours.contiguous())
    assert all(torch.equal(everyone[0], other) for other in everyone), f"ranks differ after {what}"


def _inputs(rank: int, seed: int):
    for dtype in (torch.float32, torch.int64):
        for numel in SIZES:
            seed += 1
            yield f"{dtype} numel={numel}", _rank_tensor(numel, dtype, rank, seed)
        seed += 1
        yield f"{dtype} shape (3,5,7)", _rank_tensor(105, dtype, rank, seed).view(3, 5, 7)
        seed += 1
        # A transposed (non-contiguous) view: the result must land in the caller's tensor.
        yield f"{dtype} non-contiguous", _rank_tensor(35, dtype, rank, seed).view(5, 7).t()


def _torch_mean(t: torch.Tensor, world: int) -> torch.Tensor:
    return t / world if t.is_floating_point() else t.div(world, rounding_mode="floor")


def _own_chunk(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return collectives.ring_chunks(t.reshape(-1), world)[rank]


def _check_ring_halves(x: torch.Tensor, rank: int, world: int, what: str) -> int:
    """reduce_scatter leaves this rank's chunk summed; all_gather spreads every rank's own chunk."""
    for op in ("sum", "mean"):
        ours, theirs = x.clone(), x.clone()
        collectives.reduce_scatter(ours, op=op)
        dist.all_reduce(theirs, op=dist.ReduceOp.SUM)
        want = _own_chunk(theirs, rank, world)
        _assert_equal(
            _own_chunk(ours, rank, world),
            want if op == "sum" else _torch_mean(want, world),
            f"reduce_scatter op={op} {what}",
        )
    contribution = torch.zeros_like(x).reshape(-1)  # only this rank's chunk set: a sum is then a gather
    _own_chunk(contribution, rank, world).copy_(_own_chunk(x, rank, world))
    ours, theirs = contribution.clone(), contribution.clone()
    collectives.all_gather(ours)
    dist.all_reduce(theirs, op=dist.ReduceOp.SUM)
    assert torch.equal(ours, theirs), f"all_gather {what}"
    return 3


def check_all(rank: int, world_size: int) -> None:
    """broadcast, reduce sum/mean, all_reduce star/ring sum/mean, ring reduce_scatter and
    all_gather vs torch.distributed."""
    checked = 0
    for what, x in _inputs(rank, seed=7):
        for src in range(world_size):
            ours, theirs = x.clone(), x.clone()
            collectives.broadcast(ours, src=src)
            dist.broadcast(theirs, src=src)
            assert torch.equal(ours, theirs), f"broadcast src={src} {what}"
            checked += 1
        for dst in range(world_size):
            for op in ("sum", "mean"):
                ours, theirs = x.clone(), x.clone()
                collectives.reduce(ours, dst=dst, op=op)
                dist.reduce(theirs, dst=dst, op=dist.ReduceOp.SUM)
                if rank == dst:
                    _assert_equal(
                        ours,
                        theirs if op == "sum" else _torch_mean(theirs, world_size),
                        f"reduce dst={dst} op={op} {what}",
                    )
                else:
                    assert torch.equal(ours, x), f"reduce changed non-destination rank {rank}: {what}"
                checked += 1
        # ring/40: 40-byte segments, so every chunk travels as several pipelined messages. small=0
        # forces the ring; small=None lets sizes up to SMALL_BYTES on a power-of-two world take
        # recursive doubling (every size here at world 2), segmented too with 40-byte segments.
        for algorithm, segment, small in ALL_REDUCE_VARIANTS:
            if segment and x.numel() > 2000:
                continue  # tens of thousands of tiny messages would only cost time
            for op in ("sum", "mean"):
                ours, theirs = x.clone(), x.clone()
                collectives.all_reduce(ours, op=op, algorithm=algorithm, segment_bytes=segment, small_bytes=small)
                dist.all_reduce(theirs, op=dist.ReduceOp.SUM)
                what_here = f"all_reduce {algorithm}/{segment}/small={small} op={op} {what}"
                _assert_equal(ours, theirs if op == "sum" else _torch_mean(theirs, world_size), what_here)
                _assert_same_on_every_rank(ours, world_size, what_here)
                checked += 1
        checked += _check_ring_halves(x, rank, world_size, what)
    print(f"checked {checked} over {shm.describe()}")
