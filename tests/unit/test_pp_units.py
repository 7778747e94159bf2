"""strategy.balance=time's measurement (pp/timing.py), in-process: load that drifts while the
blocks are timed must not make equal blocks look unequal (the cut would follow the drift)."""

from __future__ import annotations

import itertools
import time

import torch

from parallel_lab.strategies.pp.timing import time_blocks

BASE_S, DRIFT_S = 0.002, 0.003  # every block's own time; what each later call adds (rising load)


class DriftingBlock(torch.nn.Module):
    """An equal block on a machine whose load rises: call n (counted over all blocks) sleeps
    BASE_S + n DRIFT_S, then scales its input by its weight (something to back-propagate)."""

    def __init__(self, calls: itertools.count) -> None:
        super().__init__()
        self.calls, self.weight = calls, torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(BASE_S + next(self.calls) * DRIFT_S)
        return x * self.weight


def test_time_balance_times_equal_blocks_alike_under_drifting_load():
    """Round-robin, block k's median sample is call (repeats/2 + 1) n + k: the blocks differ by
    (n - 1) drifts at most; timed one block after another the last would take (n - 1)(repeats + 1)
    drifts more than the first (18 here), and the cut would move towards it."""
    calls = itertools.count()
    blocks = [DriftingBlock(calls) for _ in range(3)]
    times = time_blocks(blocks, torch.ones(2), repeats=5)
    assert len(times) == 3 and min(times) >= BASE_S
    assert max(times) - min(times) < 6 * DRIFT_S, times
    assert all(b.weight.grad is not None for b in blocks)  # forward and backward were timed
