"""The order in which one rank runs its forwards (F) and backwards (B), the bubble each schedule
promises, and a play-out of the orders (what the planner and the tests take as the theory).

An order is a list of ``(op, chunk, micro)``: op "F" or "B" (zero bubble: "B" the input gradient
and "W" the weight gradient, arXiv 2401.10241), ``chunk`` the rank's local model chunk
(0 .. v-1; rank s holds the global chunks s, s+p, s+2p, ..., Narayanan et al. arXiv 2104.04473),
``micro`` the micro-batch. gpipe and 1f1b hold one chunk per rank (v = 1)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

Op = tuple[str, int, int]


def gpipe_order(m: int, p: int, s: int, v: int = 1) -> list[Op]:
    """GPipe: fill the pipe with every forward, then drain it with every backward."""
    return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]


def one_f_one_b_order(m: int, p: int, s: int, v: int = 1) -> list[Op]:
    """1F1B: p-s-1 warm-up forwards, then one forward / one backward, then the last backwards.
    The oldest micro-batch is always the next to go backward, so at most p-s are in flight."""
    warmup = min(p - s - 1, m)
    order = [("F", 0, i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", 0, warmup + k), ("B", 0, k)]
    return order + [("B", 0, k) for k in range(m - warmup, m)]


def interleaved_order(m: int, p: int, s: int, v: int) -> list[Op]:
    """Interleaved 1F1B (Megatron-LM, arXiv 2104.04473 section 2.2; m a multiple of p): the k-th
    forward of a rank runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p, i.e. p
    micro-batches through one chunk, then the same p through its next chunk; backwards walk the
    chunks in reverse. (p - s - 1) * 2 + (v - 1) p warm-up forwards, then one forward / one
    backward, then the remaining backwards."""
    total = m * v

    def op(kind: str, k: int) -> Op:
        chunk = (k // p) % v
        return kind, chunk if kind == "F" else v - 1 - chunk, (k // (p * v)) * p + k % p

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op("F", warmup + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warmup, total)]


def zero_bubble_order(m: int, p: int, s: int, v: int = 1) -> list[Op]:
    """ZB-H1 (Qi et al., arXiv 2401.10241 section 3.1): 1F1B's forwards and input-gradient passes B,
    each weight-gradient pass W run s micro-batches after its B, the last s at the end. A later
    stage holds s more micro-batches until their W (p on every stage, 1F1B's first stage's peak);
    in exchange the W passes fill the bubble: with F, B and W of equal cost each rank idles
    (p-1)/(3m+p-1) of the step for m >= p, a third of 1F1B's bubble time. One chunk per rank."""
    warmup = min(p - s - 1, m)
    order, weights = [("F", 0, i) for i in range(warmup)], 0
    for k in range(m):
        if warmup + k < m:
            order.append(("F", 0, warmup + k))
        order.append(("B", 0, k))
        if k >= s:
            order.append(("W", 0, k - s))
            weights += 1
    return order + [("W", 0, k) for k in range(weights, m)]


# The manual loop's schedules (strategy.impl=torch runs its own classes, pp/torch_pipe.py).
SCHEDULES: dict[str, Callable[[int, int, int, int], list[Op]]] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved_1f1b": interleaved_order,
    "zero_bubble": zero_bubble_order,
}
INTERLEAVED = ("interleaved_1f1b", "zero_bubble")  # the schedules that take strategy.virtual_stages > 1
SPLIT_BACKWARD = ("zero_bubble",)  # backward in two passes: B (input gradient), W (weight gradient)


def bubble_fraction(schedule: str, m: int, p: int, v: int = 1) -> float:
    """The share of a step each rank idles with equal chunks: (p-1)/(m+p-1) for GPipe and 1F1B
    (arXiv 1811.06965, 1806.03377), (p-1)/(v m+p-1) for interleaved 1F1B (2104.04473: the bubble
    shrinks v-fold). Zero bubble, one chunk per rank (ZB-H1, 2401.10241): (p-1)(F+B-W) of idle
    over m(F+B+W) of work, i.e. (p-1)/(3m+p-1) with the three passes equal (m >= p); torch's
    interleaved zero bubble (v > 1) promises no number: the interleaved one is its upper bound."""
    if schedule == "zero_bubble" and v == 1:
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1) if schedule in INTERLEAVED else (p - 1) / (m + p - 1)


def rank_orders(schedule: str, m: int, p: int, v: int) -> list[list[Op]]:
    order = SCHEDULES[schedule] if schedule not in INTERLEAVED or v == 1 else interleaved_order
    return [order(m, p, s, v) for s in range(p)]


_NO_COSTS: dict = {"compute": {}, "pre": {}, "post": {}, "latency": 0.0}


def play(
    orders: list[list[Op]],
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float] | None = None,
    handoff: float = 0.0,
    costs: Sequence[dict] | None = None,
) -> tuple[float, list[float]]:
    """Play the ranks' orders out, each op starting when its rank is free and its input is there
    (F of global chunk g after F of g-1; B after B of g+1, or after its own F on the last chunk;
    W after its own B); ``forward[g]``/``backward[g]``/``weight[g]``: one micro-batch through
    global chunk g (``backward`` the input-gradient pass where the order has W passes).
    ``handoff``: seconds added to every dependency between two ranks (a tensor's crossing).
    ``costs[r]`` (measured, pp/handoffs.py): rank r's ops, {"compute": {"F3:1": s}, "pre": {...},
    "post": {...}, "latency": s}, keyed by op, global chunk and micro-batch: an op first spends its
    ``pre`` on the rank (posting receives), then waits for its input, there ``latency`` after its
    producer's compute ended on another rank, computes (its own measured compute where given, else
    the chunk's cost) and holds the rank for its ``post`` (its isend); pre and post are not busy.
    Rank r begins at its ``start`` (0 if not given).
    Returns (the step: the last op's end, each rank's busy time). A cycle (a rank waiting on a rank
    that waits on it) raises: the order would deadlock a real pipeline too."""
    p = len(orders)
    last = len(forward) - 1
    done: dict[tuple[str, int, int], float] = {}
    free = [c.get("start", 0.0) for c in costs] if costs is not None else [0.0] * p
    nxt, busy = [0] * p, [0.0] * p
    compute = {"F": forward, "B": backward, "W": weight if weight is not None else [0.0] * len(forward)}
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                op, chunk, i = orders[r][nxt[r]]
                g = chunk * p + r
                need = ("F", g - 1, i) if op == "F" else ("B", g + 1, i) if g < last else ("F", g, i)
                if op == "F" and g == 0:
                    need = None
                if op == "W":
                    need = ("B", g, i)
                if need is not None and need not in done:
                    break
                extra, key = costs[r] if costs is not None else _NO_COSTS, f"{op}{g}:{i}"
                cost = extra["compute"].get(key, compute[op][g])
                cross = handoff + extra["latency"] if need and need[1] % p != r else 0.0
                ready = done[need] + cross if need else 0.0
                start = max(free[r] + extra["pre"].get(key, 0.0), ready)
                done[(op, g, i)] = start + cost
                free[r] = start + cost + extra["post"].get(key, 0.0)
                busy[r] += cost
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the orders deadlock: ranks stop at {nxt}")
    return max(free), busy


def replay_idle(
    schedule: str,
    m: int,
    p: int,
    v: int,
    op_seconds: list[dict[str, float]],
    handoff: float = 0.0,
    costs: Sequence[dict] | None = None,
    orders: list[list[Op]] | None = None,
) -> list[float]:
    """Each rank's idle share of the step its order would take with the compute the run measured
    (``pp_op_seconds``: per rank, "F3" -> the mean seconds of a forward of global chunk 3, B and
    W likewise), ``handoff`` seconds per crossing and each rank's measured hand-off ``costs``
    (``play``): the bubble of this run's own chunks, where the formula assumes equal ones.
    ``orders``: the ranks' orders where the run built them (zero bubble, pp/zb_orders.py), else the
    schedule's."""
    seconds = {k: v for rank in op_seconds for k, v in rank.items()}
    n = p * v

    def of(op: str) -> list[float]:
        return [seconds.get(f"{op}{g}", 0.0) for g in range(n)]

    split = schedule == "zero_bubble" and v == 1
    orders = orders if orders is not None else rank_orders(schedule, m, p, v)
    step, busy = play(orders, of("F"), of("B"), of("W") if split else None, handoff, costs)
    # measured costs: each rank's step from its own start to its own end (pp/handoffs.py)
    ends = [(c.get("start", 0.0), step + c.get("flush", 0.0)) for c in costs] if costs else [(0.0, step)] * p
    return [(end - start - b) / (end - start) for (start, end), b in zip(ends, busy)]


def replay_idle_steps(
    schedule: str,
    m: int,
    p: int,
    v: int,
    op_seconds_steps: list[list[dict[str, float]]],
    costs_steps: list[list[dict]] | None = None,
    handoff: float = 0.0,
    orders: list[list[Op]] | None = None,
) -> list[float]:
    """``replay_idle`` of every measured step with that step's own compute per op
    (``pp_op_seconds_steps``: per rank, per step) and, if given, its own hand-off costs
    (``pp_handoff_steps``: per rank, per step; else ``handoff`` seconds a crossing), the median
    step's per rank: the same statistic as the measured ``pp_idle_fraction``, so an op slowed by
    another process in one step is replayed in that step only."""
    costs = zip(*costs_steps) if costs_steps is not None else [None] * len(op_seconds_steps[0])
    steps = [
        replay_idle(schedule, m, p, v, list(ops), handoff, c, orders) for ops, c in zip(zip(*op_seconds_steps), costs)
    ]
    return [statistics.median(s[r] for s in steps) for r in range(p)]


def peak_in_flight(
    order: list[Op],
    chunk_bytes: Sequence[int],
    split: Sequence[tuple[int, int]] | None = None,
) -> int:
    """The most bytes a rank's order holds for backward at once: each forward of local chunk c
    stashes ``chunk_bytes[c]`` until that chunk's backward of the same micro-batch. ``split[c]``
    (orders with W passes): (the most held during chunk c's B above what its F saved, what its B
    leaves held until its W), as ``pp/zero_bubble.py`` ``split_bytes`` counts them."""
    held, peak = 0, 0
    for op, chunk, _ in order:
        if op == "F":
            held += chunk_bytes[chunk]
        elif split is None:
            held -= chunk_bytes[chunk]
        elif op == "B":
            peak = max(peak, held + split[chunk][0])
            held += split[chunk][1] - chunk_bytes[chunk]
        else:
            held -= split[chunk][1]
        peak = max(peak, held)
    return peak


class Busy:
    """A rank's compute time in its pipeline step: the manual loop and torch's stages time each
    forward and backward call (its receives and sends outside), so both measure idle the same
    way: idle = step time - busy."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return run


def gpipe_step_time(forward: Sequence[float], backward: Sequence[float], m: int, handoff: float = 0.0) -> float:
    """How long a GPipe step takes when stage s spends ``forward[s]`` on its m forwards and
    ``backward[s]`` on its m backwards (totals, any unit; its sends folded in).

    The forwards are a flow shop of m identical jobs through stages 0..p-1: the first micro-batch
    crosses every stage, then the slowest stage lets one more through per forward of its own, so
    they end after sum(f) + (m-1) max(f) for the per-micro-batch times f = forward / m. The
    backwards start on the last stage at that moment and cross back the same way: sum(b) +
    (m-1) max(b) more (GPipe, Huang et al., arXiv 1811.06965). Equal stages give (m + p - 1)(f + b),
    whence the bubble (p-1)/(m+p-1).

    ``handoff``: the time a receiving stage waits for a tensor already sent (gloo's rendezvous:
    the data moves only once the receive is posted, and this strategy posts it when it needs the
    tensor). It lengthens every micro-batch's hop on the critical path: (m + p - 1) per direction
    at most; here counted once per micro-batch and boundary crossing of the critical path, i.e.
    (m + p - 1) in all, as the faster stage of each direction absorbs the other's."""
    p = len(forward)
    f, b = [t / m for t in forward], [t / m for t in backward]
    return sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b) + (m + p - 1) * handoff


def gpipe_first_stage_idle(forward: Sequence[float], backward: Sequence[float], m: int, handoff: float = 0.0) -> float:
    """The first stage's predicted idle time in a GPipe step: it starts the step and finishes it
    (the last backward is its own), so it idles for the whole step minus its own work."""
    return gpipe_step_time(forward, backward, m, handoff) - forward[0] - backward[0]


def zero_bubble_fraction(m: int, p: int, forward: float, backward: float, weight: float) -> float:
    """ZB-H1's idle share at these pass costs (one micro-batch through one stage's chunk, every
    stage alike): the order played out (``play``). For W <= F <= B it is Qi et al.'s own
    (p-1)(F+B-W) of idle over m(F+B+W) of work (arXiv 2401.10241 section 3.1), which
    ``bubble_fraction``'s (p-1)/(3m+p-1) is at F = B = W; B > W (norms, softmax and GELU
    backward stay in B) leaves more bubble than the equal passes do."""
    step, busy = play(rank_orders("zero_bubble", m, p, 1), [forward] * p, [backward] * p, [weight] * p)
    return (step - busy[0]) / step
