"""strategy.balance=time's measurement (pp/timing.py), in-process: load that drifts while the
blocks are timed must not make equal blocks look unequal (the cut would follow the drift)."""

from __future__ import annotations

import itertools
import time

import torch

from parallel_lab.strategies.pp.timing import time_blocks

BASE_S, DRIFT_S = 0.002, 0.008  # every block's own time; what each later call adds (rising load: large
# beside sleep's overshoot on a loaded machine, which made 0.003 fail once at load 13-17)


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


def test_time_balance_times_each_block_as_its_stage_runs_it():
    """Zero bubble's blocks are timed through B and W (the weight GEMMs put aside, then run: the
    weights end with the gradient one backward gives), the loss only on the last block, in every
    pass (one untimed, then ``repeats``); the other schedules time one backward."""
    from omegaconf import OmegaConf

    from parallel_lab.strategies.pp.timing import splits_backward

    def pair() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        return [torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)]

    shapes = []

    def loss(out: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(out.shape))
        return out.square().sum()

    x = torch.randn(2, 4)
    split, plain = pair(), pair()
    assert len(time_blocks(split, x, repeats=2, split=True, loss=loss)) == 2
    assert shapes == [(2, 3)] * 3
    time_blocks(plain, x, repeats=2, loss=loss)
    for a, b in zip(split, plain):
        assert a.weight.grad is not None and torch.allclose(a.weight.grad, b.weight.grad)
    opts = {"schedule": "zero_bubble", "impl": "manual"}
    assert splits_backward(OmegaConf.create(opts))
    assert not splits_backward(OmegaConf.create({**opts, "impl": "torch"}))  # torch splits it its own way
    assert not splits_backward(OmegaConf.create({**opts, "schedule": "1f1b"}))
