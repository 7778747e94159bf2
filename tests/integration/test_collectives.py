"""Hand-written collectives (parallel_lab.comm.collectives) equal torch.distributed's results on real
gloo process groups: broadcast, reduce SUM/MEAN, all_reduce star/ring/builtin SUM/MEAN, the ring's
reduce_scatter and all_gather, world sizes 2 and 3, sizes not divisible by the world size (and
smaller than it), float32 and int64."""

import pytest

from parallel_lab.testing import run_ranks
from tests.support.bodies.collectives import check_all


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_torch_distributed(world_size):
    outputs = run_ranks(check_all, world_size=world_size, timeout=180)
    # Every rank ran every comparison (a body that silently skipped would print fewer).
    counts = {out.strip() for out in outputs}
    assert len(counts) == 1 and counts.pop().startswith("checked "), outputs


def test_unknown_algorithm_and_op_are_rejected():
    import torch

    from parallel_lab.comm import collectives

    with pytest.raises(ValueError, match="algorithm='tree'"):
        collectives.all_reduce(torch.zeros(3), algorithm="tree")
    with pytest.raises(ValueError, match="op='max'"):
        collectives.reduce(torch.zeros(3), op="max")
