"""Where a step's time goes, read from a rank's profiler trace (Chrome trace format) by interval
arithmetic on the training thread: the thread that ran the loop's ``parallel_lab:step`` range.

What the trace holds (protocol.py names the ranges): torch's own operator events (``cpu_op``:
aten ops, autograd's backward functions, ``c10d::`` collective launches); gloo's execution of each
collective on its own threads (``gloo:<op>``); and the ranges parallel_lab opens while profiling:
``comm:<op>:<bytes>`` around every counted collective on the thread that issues it
(comm/counter.py), ``wait:<what>`` around every blocking wait (``Work.wait``, a bucket's future),
``idle:<what>`` where a pipeline stage waits for its neighbour, and the loop's step and optimizer.

Per step window W on the training thread (in this order of precedence, so the parts partition W):

- ``idle``: inside an ``idle:`` range (a pipeline stage blocked in recv: the bubble, GPipe
  arXiv 1811.06965);
- ``exposed_comm``: inside a ``comm:``/``wait:``/``c10d::`` range on the training thread (a
  blocking collective, the launch of an async one, a wait), or in a gap where the thread runs no
  operator at all while a collective of this rank is in flight on any thread (DDP's reducer waits
  for its buckets from C++, where no Python range can reach: only the gap shows it);
- ``optimizer``: inside the loop's optimizer range (what is not already communication: ZeRO's
  gathers there count as communication);
- ``compute``: inside any other operator (forward, backward, the loss);
- ``other``: the rest of W (Python between operators, the data's copy to the device).

``comm`` is not a part: it is the time any communication of this rank was in flight, on any thread
(gloo's workers, manual_ddp's communication thread), minus ``idle``; exposed_comm is a subset of it,
so overlap = 1 - exposed_comm / comm lies in [0, 1]. On a GPU the same trace holds the kernels of
every stream: ``gpu_breakdown`` measures exposure on the device instead (docs/profiling.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from parallel_lab.protocol import COMM_LABEL, IDLE_LABEL, OPTIMIZER_LABEL, STEP_LABEL, WAIT_LABEL

Interval = tuple[float, float]
PARTS = ("compute", "exposed_comm", "optimizer", "idle", "other")  # they partition the step
KEYS = ("step", "compute", "comm", "exposed_comm", "optimizer", "idle", "other")  # ranks[k].time_ms
# Communication as the trace names it: ours, torch's c10d operators, gloo's and NCCL's own events.
COMM_PREFIXES = (COMM_LABEL, WAIT_LABEL, "c10d::", "gloo:", "nccl:")
ON_THREAD_COMM = (COMM_LABEL, WAIT_LABEL, "c10d::")  # the training thread itself communicating


# ----- interval arithmetic (lists of disjoint, sorted (start, end) pairs) -----
def union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b."""
    out = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


# ----- reading a trace -----
def load_events(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace that torch.profiler exported."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _span(event: dict) -> Interval:
    return (float(event["ts"]), float(event["ts"]) + float(event["dur"]))


def step_windows(events: list[dict]) -> list[tuple[object, Interval]]:
    """(training thread id, window) of every profiled step, in time order."""
    steps = [e for e in events if e["name"] == STEP_LABEL]
    return [(e["tid"], _span(e)) for e in sorted(steps, key=lambda e: e["ts"])]


def _is_comm(event: dict) -> bool:
    name = event["name"]
    return name.startswith(COMM_PREFIXES) or (event.get("cat") == "kernel" and "nccl" in name.lower())


def classify_step(events: list[dict], main_tid: object, window: Interval) -> dict[str, list[Interval]]:
    """The step's window split into PARTS (disjoint intervals each) plus ``comm``: see the module's
    docstring for the rules and their order."""
    inside = [e for e in events if _span(e)[1] > window[0] and _span(e)[0] < window[1]]
    main = [e for e in inside if e["tid"] == main_tid]
    w = [window]
    idle = intersect(union(_span(e) for e in main if e["name"].startswith(IDLE_LABEL)), w)
    on_thread = union(_span(e) for e in main if e["name"].startswith(ON_THREAD_COMM))
    operators = union(_span(e) for e in main if e.get("cat") == "cpu_op" and not _is_comm(e))
    in_flight = intersect(union(_span(e) for e in inside if _is_comm(e)), w)
    gaps = subtract(w, union(operators + on_thread + idle))
    exposed = subtract(intersect(union(on_thread + intersect(gaps, in_flight)), w), idle)
    optimizer = subtract(
        intersect(union(_span(e) for e in main if e["name"] == OPTIMIZER_LABEL), w), union(exposed + idle)
    )
    taken = union(exposed + idle + optimizer)
    compute = subtract(intersect(operators, w), taken)
    other = subtract(w, union(taken + compute))
    comm = subtract(in_flight, idle)
    return {
        "compute": compute,
        "exposed_comm": exposed,
        "optimizer": optimizer,
        "idle": idle,
        "other": other,
        "comm": comm,
    }


def step_breakdown(parts: dict[str, list[Interval]], window: Interval) -> dict[str, float]:
    """KEYS in milliseconds (the trace's times are microseconds)."""
    out = {"step": (window[1] - window[0]) / 1000}
    out.update({key: length(parts[key]) / 1000 for key in KEYS if key != "step"})
    return out


def breakdown(events: list[dict]) -> list[dict[str, float]]:
    """Every profiled step's KEYS, in ms, in time order."""
    return [step_breakdown(classify_step(events, tid, window), window) for tid, window in step_windows(events)]


def mean_breakdown(steps: list[dict[str, float]]) -> dict[str, float]:
    """The mean profiled step (means, unlike medians, keep the parts adding up to the step)."""
    return {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]} if steps else {}


def overlap(time_ms: dict[str, float]) -> float | None:
    """The share of communication hidden behind other work; None where there was none."""
    return 1 - time_ms["exposed_comm"] / time_ms["comm"] if time_ms.get("comm") else None


def gpu_breakdown(events: list[dict]) -> list[dict[str, float]]:
    """On a GPU, per profiled step: kernel time on the device (ms) of ``compute`` and ``comm``
    (NCCL) kernels, ``exposed_comm`` (NCCL kernels while no compute kernel runs on any stream: the
    device waits on communication) and ``idle`` (no kernel at all). [] for a CPU trace."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return []
    out = []
    for _, window in step_windows(events):
        w = [window]
        comm = intersect(union(_span(e) for e in kernels if _is_comm(e)), w)
        compute = intersect(union(_span(e) for e in kernels if not _is_comm(e)), w)
        busy = union(comm + compute)
        out.append(
            {
                "step": (window[1] - window[0]) / 1000,
                "compute": length(compute) / 1000,
                "comm": length(comm) / 1000,
                "exposed_comm": length(subtract(comm, compute)) / 1000,
                "idle": length(subtract(w, busy)) / 1000,
            }
        )
    return out
