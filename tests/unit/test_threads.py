"""``parallel_lab.threads.torch_threads``: the block runs on the count asked for, and the caller's
count comes back after it, also when the block raises."""

from __future__ import annotations

import pytest
import torch

from parallel_lab.threads import torch_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_sets_the_count_and_restores_it_after_a_raise(two_threads):
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("the block failed")
    assert torch.get_num_threads() == 2


def test_none_leaves_the_count_and_zero_means_one(two_threads):
    with torch_threads(None):
        assert torch.get_num_threads() == 2
    with torch_threads(0):  # trainer.threads_per_rank=0 on a caller: at least one thread
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
