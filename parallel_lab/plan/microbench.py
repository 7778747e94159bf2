"""Timing helpers the quick calibration (``calibrate.py``) and its two-process half
(``comm_calibration.py``) share."""

from __future__ import annotations

import socket
import statistics
import time

import torch

# Five sizes, 4 KiB-16 MiB, least squares through them (``alphabeta.fit_alpha_beta``). With two sizes
# (4 KiB, 1 MiB) and 3 repetitions, eight calibrations in a row priced resnet18's all-reduce (45 MB)
# at 5-29x the cnn's and zero3's all-gathers at 0.17-0.42x fsdp's. With these five sizes and 5
# repetitions, ten calibrations gave 16-26x and 0.35-0.50x (docs/plan.md). The calibration took
# 3.4-5.0 s; with both interleaved in rounds (calibrate.OPS_ROUNDS, comm_calibration.COMM_ROUNDS)
# 6.2-7.7 s in a fresh process.
COMM_SIZES = (4096, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def on_gpu(device: str) -> bool:
    return str(device).startswith("cuda")  # "cuda" or a rank's "cuda:<k>"


def sync(device: str) -> None:
    if on_gpu(device):
        torch.cuda.synchronize(device)


# A CPU benchmark's repetitions stop at about this many seconds: a pass this long is timed to a
# fraction of a per cent (the fastest of several matters for the short ones, where a passing
# interruption is the whole difference), and this machine's bf16 matmuls (no bf16 units: 0.5-1 s a
# pass) took 23 of a cold calibration's 31 s of operators at 4 repetitions x 3 rounds.
REPS_BUDGET_S = 0.25


def time_pass(module: torch.nn.Module, shape: tuple, dtype: torch.dtype, device: str, reps: int = 4) -> float:
    """The fastest of ``reps`` forward+backward passes (after one warm-up): ``pass_timer``'s first timing."""
    return pass_timer(module, shape, dtype, device, reps)()


def pass_timer(module: torch.nn.Module, shape: tuple, dtype: torch.dtype, device: str, reps: int = 4):
    """A function that returns the fastest of ``reps`` forward+backward passes of ``module`` on an
    input of ``shape``, warmed up once here (allocations, kernel choice): the machine's cost with
    the least interference, what the calibration set's scale then corrects for the real run. The
    calibration's rounds call it again without a new warm-up (``calibrate.measure_ops``). On a CPU,
    a pass whose warm-up took more than ``REPS_BUDGET_S / reps`` is repeated only as often as fits
    that budget (at least once).

    On a GPU, the ``reps`` passes back to back with one synchronisation, per pass: a training step
    launches its kernels without waiting for them, so an operator costs its launch or its kernel,
    whichever is longer, never both plus a round trip. Timed one pass at a time, the H100's per-call
    costs came out 40-170 us, several times a launch (docs/gpu.md)."""
    module = module.to(device=device, dtype=dtype)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    t0 = time.perf_counter()
    module(x).sum().backward()  # warm-up: allocations, kernel choice
    warm_s = time.perf_counter() - t0
    cpu_reps = max(1, min(reps, int(REPS_BUDGET_S / warm_s)))

    def fastest() -> float:
        if on_gpu(device):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                module(x).sum().backward()
            sync(device)
            return (time.perf_counter() - t0) / reps
        times = []
        for _ in range(cpu_reps):
            t0 = time.perf_counter()
            module(x).sum().backward()
            times.append(time.perf_counter() - t0)
        return min(times)

    return fastest


PROBE_REPS = 7


def contention_probe(device: str, before_each=None) -> float:
    """The median time of ``PROBE_REPS`` probe passes (a 256x1024 by 1024x1024 linear, forward and
    backward), after one warm-up. ``before_each``: called untimed before every pass (the two
    processes' barrier, so each pass of one runs while the other's does).

    The median, not the fastest: timed as the fastest of 5 free-running passes, the pair's ratio
    came out either ~1.03 or ~1.27 (ten quick calibrations in a row: five of each kind, one
    process having finished while the other still timed), and once 1.88, which priced every
    two-rank candidate of ``bench recommend`` 1.6x high (docs/plan.md)."""
    module = torch.nn.Linear(1024, 1024).to(device)
    x = torch.randn(256, 1024, device=device, requires_grad=True)
    module(x).sum().backward()
    times = []
    for _ in range(PROBE_REPS):
        if before_each is not None:
            before_each()
        sync(device)
        t0 = time.perf_counter()
        module(x).sum().backward()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
