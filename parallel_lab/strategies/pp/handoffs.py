"""What a pipeline's hand-offs cost, measured in the run (the manual loop, ``pp/manual.py``): the
part of a stage's idle that is neither its own compute nor the schedule's bubble.

The loop marks every op of a step on the host's monotonic clock (``time.perf_counter``: one clock
for every process of a host): its ``begin``, where it started waiting for its input (``wait``) and
got it (``got``), its compute (``compute`` .. ``computed``), its ``end`` (after its isend) and where
its receives were ``posted``. Per stage and step that gives, per op ("F3:1": the forward of global
chunk 3 on micro-batch 1), its compute and:

- ``pre``: begin to the wait (or the compute): the Python between ops, and for a step's first op
  the step's prologue (its receives posted: ``irecv``); on this stage's core, before its input
  can be used;
- ``post``: the compute's end to the op's end: the ``isend`` call (gloo writes what the socket
  takes in the calling thread) and the Python after it;
- ``latency`` (one number per stage and step): a tensor's crossing into this stage, from the producer's
  compute ending to this stage's ``recv`` returning, the producer's isend call included. Taken over
  the hand-offs this stage was already waiting for when the producer's compute ended: their whole
  delay is the hand-off's, and which hand-offs qualify does not depend on how long they took (a
  hand-off that arrived before its receiver asked shows only an upper bound).

``schedules.play`` adds them to the orders played out with the measured compute: the replay's
idle is then the schedule's bubble plus these costs, as the run had them (docs/pp.md, "The bubble
bench"). Torch-free.

The per-op record is bounded as the profiler's trace is (a window of steps after the warm-up,
``trainer.profile_steps``): the loop keeps the marks and op times of its first ``RECORDED_STEPS``
steps after the warm-up (``StepRecord``) and later steps only while they run, so the hand-off
record in metrics.json (``pp_handoff_steps``, ``pp_op_seconds_steps``) has the same size at 10,000
steps as at 20."""

from __future__ import annotations

import statistics

RECORDED_STEPS = 16  # steps after the warm-up whose per-op marks and times a run keeps (docs/pp.md)
MARKS = ("begin", "posted", "wait", "got", "compute", "computed", "end")  # the loop's per-op marks, in order


class StepRecord:
    """One per-step record of the loop (its op marks, or its op times): ``start`` begins a step's
    entry, which the loop fills in; only the first ``skip + RECORDED_STEPS`` entries are kept
    (``skip``: the warm-up's train_step calls), a later step's entry is filled and dropped."""

    def __init__(self, skip: int, make: type = dict) -> None:
        self.skip, self.make = skip, make
        self.steps: list = []
        self.current = make()

    def start(self, **fields) -> dict:
        self.current = self.make(**fields)
        if len(self.steps) < self.skip + RECORDED_STEPS:
            self.steps.append(self.current)
        return self.current

    def recorded(self) -> list:
        """The kept steps after the warm-up (all kept ones if the run has none after it)."""
        return self.steps[self.skip :] or self.steps


def _ops(timeline: dict) -> dict[tuple[str, int, int], dict]:
    """(op, global chunk, micro-batch) -> its marks, for one stage's step."""
    return {(op, g, i): dict(zip(MARKS, marks)) for op, g, i, *marks in timeline["ops"]}


def producer(op: str, g: int, i: int) -> tuple[str, int, int]:
    """The op whose tensor op (op, g, i) receives: the forward of chunk g - 1, the backward of g + 1."""
    return ("F", g - 1, i) if op == "F" else ("B", g + 1, i)


def step_costs(timelines: list[dict], one_clock: bool = True) -> list[dict]:
    """One step's measured costs per stage from every stage's marks of that step (stage order):
    {"compute": {"F3:1": s, ...}, "pre": {...}, "post": {...}, "latency": s or None, "start": s,
    "flush": s}, the ops keyed by op,
    global chunk and micro-batch (each op its own: an op computing while its neighbour idles runs
    faster than one computing beside it, and a mean per chunk moves that time into the bubble);
    latency None: no hand-off it waited for, or the stages on hosts of their own (``one_clock``
    False: their marks are on different clocks). ``start``: how long after the first stage this
    one began the step (it left the last optimizer step later); ``flush``: its step's end after the
    pipeline's last op ended (the last sends' completion and the flush barrier, one more hand-off).
    With ``one_clock`` False both are 0."""
    ops = [_ops(t) for t in timelines]
    made = {key: marks for stage in ops for key, marks in stage.items()}
    out = []
    for stage in ops:
        costs: dict = {"compute": {}, "pre": {}, "post": {}}
        crossings = []
        for (op, g, i), t in stage.items():
            key = f"{op}{g}:{i}"
            costs["compute"][key] = t["computed"] - t["compute"]
            costs["pre"][key] = (t["wait"] if t["wait"] is not None else t["compute"]) - t["begin"]
            costs["post"][key] = t["end"] - t["computed"]
            source = made.get(producer(op, g, i)) if t["wait"] is not None and one_clock else None
            if source is not None and t["wait"] <= source["computed"]:
                crossings.append(t["got"] - source["computed"])
        out.append({**costs, "latency": statistics.fmean(crossings) if crossings else None})
    for costs, t in zip(out, timelines):  # the step's prologue (its receives posted) is its first op's
        if t["ops"]:
            op, g, i, begin = t["ops"][0][:4]
            costs["pre"][f"{op}{g}:{i}"] += begin - t["start"]
    first = min(t["start"] for t in timelines)
    last = max(t["ops"][-1][3 + MARKS.index("end")] for t in timelines if t["ops"])
    for costs, t in zip(out, timelines):
        costs["start"], costs["flush"] = (t["start"] - first, t["end"] - last) if one_clock else (0.0, 0.0)
    return out


def compute_only(costs_steps: list[list[dict]]) -> list[list[dict]]:
    """The same steps with each op's measured compute and no hand-off cost (the replay's baseline)."""
    return [[{"compute": c["compute"], "pre": {}, "post": {}, "latency": 0.0} for c in stage] for stage in costs_steps]


def costs_per_step(stage_timelines: list[list[dict]], one_clock: bool = True) -> list[list[dict]]:
    """``step_costs`` of every step (``stage_timelines``: per stage, per step), per stage, per step;
    a step in which a stage waited for no hand-off takes that stage's mean latency over the other
    steps (0 if it never waited for one)."""
    steps = [step_costs(list(step), one_clock) for step in zip(*stage_timelines)]
    per_stage = [[step[s] for step in steps] for s in range(len(stage_timelines))]
    for stage in per_stage:
        known = [c["latency"] for c in stage if c["latency"] is not None]
        fill = statistics.fmean(known) if known else 0.0
        for c in stage:
            c["latency"] = fill if c["latency"] is None else c["latency"]
    return per_stage


def summary(per_stage: list[list[dict]]) -> dict[str, list[float]]:
    """Per stage: the mean latency of a crossing into it, and the mean time an op spends on its
    core outside its compute and its waits (pre + post), over the steps."""
    latency = [statistics.fmean(c["latency"] for c in stage) if stage else 0.0 for stage in per_stage]
    overhead = []
    for stage in per_stage:
        per_op = [c["pre"][key] + c["post"][key] for c in stage for key in c["pre"]]
        overhead.append(statistics.fmean(per_op) if per_op else 0.0)
    return {"latency_s": latency, "op_overhead_s": overhead}
