"""The calibration's bucketing timings (``calibrate.measure_calibration``): what a data-parallel
strategy that all-reduces buckets from its own backward hooks pays beyond one all-reduce after
backward, the pattern of PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020, arXiv
2006.15704) that ``strategy=manual_ddp strategy.bucketed=true`` writes by hand:

- ``grad_hook_s``: one post-accumulate-grad hook call (autograd calling back into Python, the
  hook's count of the bucket's ready gradients), per parameter and pass;
- ``handoff_s``: one bucket handed to the communication thread and waited for (the executor's
  queue, the thread's wake-up, the future's result), per bucket and step.

Both are Python and scheduler costs of this machine, not bytes: measured, never fitted on a run.
The step-time model charges them (``steptime.bucketing_seconds``) wherever the strategy's compute
shape names hooks or hand-offs (``ComputeShape.grad_hooks``, ``ComputeShape.handoffs``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

HOOK_PARAMS = 64  # one-element parameters under one cat: backward is little beyond the hooks
HANDOFFS = 32  # round trips per timed sample
REPS = 11


def _backward_seconds(params: list[torch.nn.Parameter]) -> float:
    start = time.perf_counter()
    torch.cat(params).sum().backward()
    return time.perf_counter() - start


def measure_grad_hook(reps: int = REPS) -> float:
    """Seconds one post-accumulate-grad hook adds to backward: two sets of ``HOOK_PARAMS``
    parameters, one with a counting hook on each, their backwards alternated; the median of the
    paired differences per parameter (a difference of two fastest times swung 0-49 us under load)."""
    plain, hooked = ([torch.nn.Parameter(torch.zeros(1)) for _ in range(HOOK_PARAMS)] for _ in range(2))
    ready = [0]

    def hook(_param: torch.Tensor) -> None:
        ready[0] += 1

    handles = [p.register_post_accumulate_grad_hook(hook) for p in hooked]
    _backward_seconds(plain), _backward_seconds(hooked)  # autograd's first use
    diffs = sorted(_backward_seconds(hooked) - _backward_seconds(plain) for _ in range(reps))
    for h in handles:
        h.remove()
    return max(0.0, diffs[len(diffs) // 2] / HOOK_PARAMS)


def measure_handoff(reps: int = 5) -> float:
    """Seconds one bucket's hand-off to a one-thread executor and the wait for its result cost
    (the work itself empty): the fastest of ``reps`` means over ``HANDOFFS`` round trips."""
    best = float("inf")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="calibration_comm") as pool:
        pool.submit(int).result()  # the thread starts
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(HANDOFFS):
                pool.submit(int).result()
            best = min(best, (time.perf_counter() - start) / HANDOFFS)
    return best


def measure_bucketing() -> dict[str, float]:
    """``{"grad_hook_s", "handoff_s"}`` of this machine (a few ms in all; CPU Python either way:
    on a GPU the hooks and the thread are the same host code)."""
    return {"grad_hook_s": measure_grad_hook(), "handoff_s": measure_handoff()}
