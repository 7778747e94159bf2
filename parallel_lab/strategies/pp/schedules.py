"""The order in which one stage runs its forwards (F) and backwards (B), and how its busy time is
measured, the same way for both implementations."""

from __future__ import annotations

import time
from typing import Sequence

from torch import nn


def gpipe_order(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """GPipe: fill the pipe with every forward, then drain it with every backward."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """1F1B: p-s-1 warm-up forwards, then one forward / one backward, then the last backwards.
    The oldest micro-batch is always the next to go backward, so at most p-s are in flight."""
    warmup = min(p - s - 1, m)
    order = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(m - warmup, m)]


SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}


class BusyTimer:
    """Time a stage spends computing (forward and backward of its blocks), from hooks, so both
    implementations measure idle time the same way: idle = step time - busy time.

    Forward: between the module's forward pre-hook and forward hook. Backward: from the moment
    the gradient of the stage's output arrives (a hook on the output tensor) to the last
    accumulation into one of its parameters (the first layers' gradients come last)."""

    def __init__(self, module: nn.Module) -> None:
        self.busy = 0.0
        self.enabled = False
        self._start: float | None = None
        module.register_forward_pre_hook(lambda *_: self._begin())
        module.register_forward_hook(self._after_forward)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda _: self._end(keep_open=True))

    def _after_forward(self, module, inputs, output) -> None:
        self._end()
        if output.requires_grad:
            output.register_hook(lambda grad: self._begin())

    def _begin(self) -> None:
        self._start = time.perf_counter()

    def _end(self, keep_open: bool = False) -> None:
        if self._start is None or not self.enabled:
            return
        now = time.perf_counter()
        self.busy += now - self._start
        self._start = now if keep_open else None


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
