"""The trace arithmetic of parallel_lab/worker/timeline.py on hand-made events (no processes)."""

from __future__ import annotations

import pytest

from parallel_lab.protocol import OPTIMIZER_LABEL, STEP_LABEL
from parallel_lab.worker import timeline as T

MAIN, GLOO = 1, 2


def ev(name: str, start: float, end: float, tid: int = MAIN, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": start, "dur": end - start, "tid": tid, "cat": cat}


def step(*events: dict, end: float = 100.0) -> dict[str, float]:
    (result,) = T.breakdown([ev(STEP_LABEL, 0, end, cat="user_annotation"), *events])
    assert sum(result[k] for k in T.PARTS) == pytest.approx(result["step"])
    return {k: v * 1000 for k, v in result.items()}  # back to the events' microseconds


def test_interval_arithmetic():
    assert T.union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert T.intersect([(0, 3), (5, 7)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert T.subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert T.length(T.subtract([(0, 10)], [(0, 10)])) == 0


def test_collective_behind_compute_is_hidden():
    """An all-reduce on gloo's thread while the training thread computes: comm, none exposed."""
    t = step(ev("aten::conv2d", 0, 80), ev("gloo:all_reduce", 20, 60, tid=GLOO))
    assert (t["comm"], t["exposed_comm"], t["compute"], t["other"]) == (40, 0, 80, 20)


def test_waits_and_gaps_while_in_flight_are_exposed():
    """A wait range on the training thread is exposed; so is a gap with a collective in flight
    (DDP's C++ wait), but not a gap with nothing in flight."""
    t = step(
        ev("aten::mm", 0, 40),
        ev("gloo:all_reduce", 30, 70, tid=GLOO),
        ev("wait:work", 60, 70, cat="user_annotation"),
        ev("aten::add", 80, 90),
    )
    assert t["exposed_comm"] == 30  # 40..60 gap in flight + 60..70 wait
    assert t["comm"] == 40 and t["compute"] == 50 and t["other"] == 20


def test_idle_beats_wait_and_optimizer_excludes_comm():
    t = step(
        ev("idle:recv", 0, 30, cat="user_annotation"),
        ev("wait:work", 0, 30, cat="user_annotation"),
        ev(OPTIMIZER_LABEL, 50, 100, cat="user_annotation"),
        ev("aten::_foreach_add", 50, 80),
        ev("comm:all_gather_into_tensor:4096", 80, 95, cat="user_annotation"),
    )
    assert t["idle"] == 30 and t["exposed_comm"] == 15 and t["optimizer"] == 35
    assert t["comm"] == 15  # the blocked recv is idle, not communication
    assert T.overlap({"exposed_comm": 15, "comm": 15}) == 0


def test_gpu_kernels():
    (g,) = T.gpu_breakdown(
        [
            ev(STEP_LABEL, 0, 100, cat="user_annotation"),
            ev("volta_sgemm", 0, 50, tid=7, cat="kernel"),
            ev("ncclDevKernel_AllReduce", 40, 70, tid=8, cat="kernel"),
        ]
    )
    assert g == {"step": 0.1, "compute": 0.05, "comm": 0.03, "exposed_comm": 0.02, "idle": 0.03}
    assert T.gpu_breakdown([ev(STEP_LABEL, 0, 100, cat="user_annotation")]) == []
