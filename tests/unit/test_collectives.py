"""Hand-written collectives (parallel_lab.comm.collectives), in-process: an unknown algorithm or op
is refused before anything is sent. Their results on real gloo ranks: tests/integration/test_collectives.py."""

import pytest


def test_unknown_algorithm_and_op_are_rejected():
    import torch

    from parallel_lab.comm import collectives

    with pytest.raises(ValueError, match="algorithm='tree'"):
        collectives.all_reduce(torch.zeros(3), algorithm="tree")
    with pytest.raises(ValueError, match="op='max'"):
        collectives.reduce(torch.zeros(3), op="max")
