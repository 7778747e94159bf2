"""The order in which one stage runs its forwards (F) and backwards (B), and how its busy time is
measured, the same way for both implementations."""

from __future__ import annotations

import time

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
