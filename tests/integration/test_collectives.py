"""Hand-written collectives (parallel_lab.comm.collectives) equal torch.distributed's results on real
gloo process groups: broadcast, reduce SUM/MEAN, all_reduce star/ring/builtin SUM/MEAN, the ring's
reduce_scatter and all_gather, world sizes 2, 3 and 4 (the small-message recursive doubling runs on
powers of two), sizes not divisible by the world size (and smaller than it), float32 and int64, and
the same bits on every rank. Bad arguments, in-process: tests/unit/test_collectives.py."""

import pytest

from parallel_lab.cli.run import run_ranks
from tests.support.bodies.collectives import check_all


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_torch_distributed(world_size):
    outputs = run_ranks(check_all, world_size=world_size, timeout=180)
    # Every rank ran every comparison (a body that silently skipped would print fewer).
    counts = {out.strip() for out in outputs}
    assert len(counts) == 1 and counts.pop().startswith("checked "), outputs
