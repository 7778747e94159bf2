"""Hand-written collectives (parallel_lab.comm.collectives) equal torch.distributed's results on real
gloo process groups: broadcast, reduce SUM/MEAN, all_reduce star/ring/builtin SUM/MEAN, the ring's
reduce_scatter and all_gather, world sizes 2, 3 and 4 (the small-message recursive doubling runs on
powers of two), sizes not divisible by the world size (and smaller than it), float32 and int64, and
the same bits on every rank; the ring over shared memory (the default on one host) and over gloo's
isend/irecv (``PARALLEL_LAB_HAND_TRANSPORT=p2p``). The shm transport's own checks: test_shm.py.
Bad arguments, in-process: tests/unit/test_collectives.py."""

import pytest

from parallel_lab.cli.run import run_ranks
from parallel_lab.comm.shm import TRANSPORT_ENV
from tests.support.bodies.collectives import check_all


@pytest.mark.floats  # float reductions to 1e-6 of gloo's
@pytest.mark.parametrize(
    "world_size, transport",
    [
        (2, "auto"),
        (3, "auto"),
        # world 4's shm ring: the same code as world 3's (an odd and an even ring in make test)
        pytest.param(4, "auto", marks=pytest.mark.extra),
        # The gloo isend/irecv path (what ranks on several hosts use): its ring at world 2 and 3 is
        # also compared bit for bit with shm's in test_shm.py, so only world 4 (recursive doubling
        # on four ranks) runs by default.
        pytest.param(2, "p2p", marks=pytest.mark.extra),
        pytest.param(3, "p2p", marks=pytest.mark.extra),
        (4, "p2p"),
    ],
)
def test_collectives_match_torch_distributed(world_size, transport):
    """``auto``: every rank is on this host, so the ring's all_reduce, reduce_scatter and all_gather
    run over shared memory (comm/shm.py); ``p2p``: over gloo's isend/irecv."""
    env = {TRANSPORT_ENV: transport}
    outputs = run_ranks(check_all, world_size=world_size, timeout=180, env=env)
    # Every rank ran every comparison (a body that silently skipped would print fewer).
    counts = {out.strip() for out in outputs}
    assert len(counts) == 1 and counts.pop().startswith("checked "), outputs
    used = "shm" if transport == "auto" else "p2p"  # the ring really ran over the transport named
    assert outputs[0].split("over ")[1].startswith(used), outputs
