"""The quick calibration's two-process half (``parallel_lab.plan.comm_calibration``) on a CPU: two
forks of this process (no fresh interpreter: torch is already imported here), each a real rank of a
gloo group, which measure the contention probe and every collective of gloo and of manual_ddp's
hand-written ring and star and hand back rank 0's points; the parent fits alpha-beta per op. Real processes
and real collectives; what is checked is the shape of the answer (every op measured and fitted, a
positive bandwidth, both forks gone), never how fast this machine is."""

from __future__ import annotations

import os

import torch.distributed as dist

from parallel_lab.plan.comm_calibration import HAND_OPS, STAR_OP, finish_pairs, start_pairs, wait_ready
from parallel_lab.plan.microbench import COMM_OPS, contention_probe


def test_the_two_processes_are_forks_that_measure_every_collective() -> None:
    assert not dist.is_initialized()  # a caller inside a process group gets fresh interpreters instead
    procs = start_pairs("cpu")
    assert procs is not None and len(procs) == 2
    assert all(p.conn is not None for p in procs), "not forked: each would import torch again (~2.6 s of CPU)"
    assert {p.proc.pid for p in procs}.isdisjoint({os.getpid()})
    wait_ready(procs)
    pair = finish_pairs(procs, contention_probe("cpu"), "cpu")
    assert all(p.code() == 0 for p in procs), [p.code() for p in procs]  # both ended by themselves, cleanly
    assert set(pair["collectives"]) == {"gloo", "hand"}
    assert set(pair["collectives"]["gloo"]) == set(COMM_OPS)
    assert set(pair["collectives"]["hand"]) == {*HAND_OPS, STAR_OP}  # the star timed beside the ring
    for impl, by_op in pair["collectives"].items():
        for op, fit in by_op.items():
            assert fit["alpha_s"] >= 0 and fit["beta_Bps"] > 0, (impl, op, fit)
    assert pair["contention"] >= 1.0
