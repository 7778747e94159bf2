"""Zero bubble's order built from each stage's measured F, B and W (Qi et al., arXiv 2401.10241
section 3.1, automatic scheduling): ZB-H1's fixed order assumes every stage spends the same on a
forward, an input-gradient pass and a weight-gradient pass; a real cut does not (the first stage
holds the embedding, the last the loss), and the stage that finishes the step then idles more than
1F1B's would. Qi et al. build the order from profiled pass times instead: a greedy that runs a
stage's F or B as soon as its input is there, fills the stage's idle time with pending W passes,
and runs W whenever the memory limit stops the next F; it tries a few variants and keeps the
shortest step. Here the same, under ZB-H1's memory limit (at most p micro-batches between a
forward and its W on every stage: 1F1B's first stage's peak), so ``peak_in_flight`` of the built
order is the plan. The candidates always include 1F1B's order with each W right after its B (the
gradient leaves a W earlier than under 1F1B, so no stage finishes later: the played step is at most
1F1B's) and ZB-H1's own order: the built order's step is at most both, at the given costs.

Torch-free: every rank builds the same orders from the same numbers (``strategy.pass_times``, the
parent's measurement, pp/timing.py), and the planner builds them too."""

from __future__ import annotations

from typing import Sequence

from parallel_lab.strategies.pp.schedules import Op, one_f_one_b_order, play, zero_bubble_order

Passes = Sequence[Sequence[float]]  # per stage: one micro-batch's (F, B, W) seconds through it
GAPS = (0.0, 1.0)  # fill an idle stretch with W when it lasts at least this share of a W (the variants)


def w_after_b_orders(m: int, p: int) -> list[list[Op]]:
    """1F1B's order with each backward split into B and its W right after it (no W deferred)."""
    out = []
    for s in range(p):
        order: list[Op] = []
        for op, c, i in one_f_one_b_order(m, p, s):
            order += [(op, c, i)] if op == "F" else [("B", c, i), ("W", c, i)]
        out.append(order)
    return out


class _Stage:
    """One stage's progress in the greedy: its clock, its order so far, the micro-batches it has
    forwarded and backpropagated (done times) and those waiting for their W."""

    def __init__(self, m: int) -> None:
        self.t, self.order, self.weights = 0.0, [], 0
        self.f: list[float] = []
        self.b: list[float] = []
        self.pending: list[int] = []
        self.total = 3 * m


def greedy_orders(
    m: int, p: int, passes: Passes, limit: int, b_first: bool = True, gap: float = 0.0, handoff: float = 0.0
) -> list[list[Op]]:
    """The stages' orders from a list-scheduling play: the stage with the earliest clock chooses
        its next op (B or F whose input has arrived, ``b_first`` deciding a tie; else a pending W if
        no input can arrive within ``gap`` W of now; else it waits for the earliest input, once that
        is known). A forward is allowed while fewer than ``limit`` micro-batches are between their F
    and their W on the stage."""
    stages = [_Stage(m) for _ in range(p)]
    for _ in range(3 * m * p):
        left = sorted((r for r in range(p) if len(stages[r].order) < stages[r].total), key=lambda r: (stages[r].t, r))
        if not any(_step(stages, s, m, p, passes, limit, b_first, gap, handoff) for s in left):
            _commit(stages, left, m, p, passes, limit, handoff)
    return [st.order for st in stages]


def _commit(stages: list[_Stage], left: list[int], m: int, p: int, passes: Passes, limit: int, handoff: float) -> None:
    """Every stage waits on another: the earliest stage with an input known commits to it (or
    runs a pending W); a stage with neither everywhere would be a deadlock."""
    for s in left:
        known = {op: r for op, r in _ready(stages, s, m, p, limit, handoff).items() if r is not None}
        if known:
            op = min(known, key=lambda o: (known[o], o))
            _run(stages[s], s, op, known[op], passes)
            return
        if stages[s].pending:
            _run(stages[s], s, "W", stages[s].t, passes)
            return
    raise RuntimeError("the greedy stalls: no stage can run an op")


def _ready(stages: list[_Stage], s: int, m: int, p: int, limit: int, handoff: float) -> dict[str, float | None]:
    """When stage s's next B and next F can start (None: their input's producer has not run it
    yet; absent: none left, or the memory limit stops the F)."""
    st, out = stages[s], {}
    if len(st.b) < len(st.f):
        i = len(st.b)
        up = stages[s + 1].b if s < p - 1 else None
        out["B"] = st.f[i] if up is None else (up[i] + handoff if i < len(up) else None)
    if len(st.f) < m and len(st.f) - st.weights < limit:
        i = len(st.f)
        down = stages[s - 1].f if s > 0 else None
        out["F"] = 0.0 if down is None else (down[i] + handoff if i < len(down) else None)
    return out


def _earliest(stages: list[_Stage], s: int, op: str, passes: Passes, handoff: float) -> float:
    """The earliest an input not yet produced can arrive: after its producer's clock and pass."""
    r = s + 1 if op == "B" else s - 1
    return stages[r].t + passes[r][1 if op == "B" else 0] + handoff


def _step(
    stages: list[_Stage], s: int, m: int, p: int, passes: Passes, limit: int, b_first: bool, gap: float, handoff: float
) -> bool:
    """Stage s runs its next op if it can decide one now; False: it waits on another stage."""
    st, now = stages[s], stages[s].t
    ready = _ready(stages, s, m, p, limit, handoff)
    prefer = ("B", "F") if b_first else ("F", "B")
    here = [op for op in prefer if ready.get(op) is not None and ready[op] <= now]
    if here:
        return _run(st, s, here[0], now, passes)
    arrive = {op: r if r is not None else _earliest(stages, s, op, passes, handoff) for op, r in ready.items()}
    if st.pending and (not arrive or min(arrive.values()) - now >= gap * passes[s][2]):
        return _run(st, s, "W", now, passes)  # the stage would idle: fill it with a weight pass
    known = {op: r for op, r in ready.items() if r is not None}
    if not known or min(known.values()) > min(arrive.values()):
        return False  # an input not yet produced may come first: let its producer run
    op = min(known, key=lambda o: (known[o], prefer.index(o)))
    return _run(st, s, op, known[op], passes)


def _run(st: _Stage, s: int, op: str, ready: float, passes: Passes) -> bool:
    start = max(st.t, ready)
    st.t = start + passes[s]["FBW".index(op)]
    if op == "F":
        st.order.append(("F", 0, len(st.f)))
        st.f.append(st.t)
    elif op == "B":
        st.order.append(("B", 0, len(st.b)))
        st.pending.append(len(st.b))
        st.b.append(st.t)
    else:
        st.order.append(("W", 0, st.pending.pop(0)))
        st.weights += 1
    return True


def candidates(m: int, p: int, passes: Passes, handoff: float = 0.0) -> list[list[list[Op]]]:
    """The orders the builder chooses from: the greedy's variants, ZB-H1's, and 1F1B's with W after B."""
    out = []
    for b_first in (True, False):
        for gap in GAPS:
            out.append(greedy_orders(m, p, passes, p, b_first, gap, handoff))
    return out + [[zero_bubble_order(m, p, s) for s in range(p)], w_after_b_orders(m, p)]


def built_orders(m: int, p: int, passes: Passes, handoff: float = 0.0) -> list[list[Op]]:
    """The candidate whose play (``schedules.play`` at these per-stage passes) ends the step first;
    the first such in ``candidates``' order, so every rank picks the same."""
    best, best_step = None, None
    for orders in candidates(m, p, passes, handoff):
        step = played_step(orders, passes, handoff)
        if best_step is None or step < best_step - 1e-12:
            best, best_step = orders, step
    return best


def played_step(orders: list[list[Op]], passes: Passes, handoff: float = 0.0) -> float:
    """The step these orders take with these per-stage (F, B, W) (``schedules.play``)."""
    f, b, w = ([x[k] for x in passes] for k in range(3))
    return play(orders, f, b, w, handoff)[0]


def stage_passes(opts) -> list[tuple[float, float, float]] | None:
    """Each stage's (F, B, W) for one micro-batch from ``strategy.pass_times`` (per block, the
    parent's measurement) summed over the stage's blocks as balance=time cuts them; None where the
    run has no pass times (the fixed ZB-H1 order runs)."""
    times = [list(t) for t in (opts.get("pass_times") or [])]
    if not times or str(opts.schedule) != "zero_bubble" or str(opts.get("impl", "manual")) != "manual":
        return None
    from parallel_lab.strategies.pp.plan import balanced_cuts

    p = opts.stages
    bounds = (0, *balanced_cuts(list(opts.block_times), p), len(times))
    return [tuple(sum(t[k] for t in times[a:e]) for k in range(3)) for a, e in zip(bounds, bounds[1:])]


def run_orders(opts) -> list[list[Op]]:
    """Every rank's order as the run's options make it: zero bubble built from the measured
    passes where the run has them, else the schedule's own (``schedules.rank_orders``)."""
    from parallel_lab.strategies.pp.schedules import rank_orders

    o = opts
    passes = stage_passes(o)
    if passes is not None:
        return built_orders(o.microbatches, o.stages, passes)
    return rank_orders(str(o.schedule), o.microbatches, o.stages, o.get("virtual_stages", 1))
