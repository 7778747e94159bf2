"""The calibration's optimizer timings (``calibrate.measure_calibration``): one step of the runs' own
Adam (``adam_step``, which ``calibrate.measure_optimizer`` fits per parameter and per tensor) and what
each tensor adds as a DTensor shard (FSDP2: ``measure_dtensor_optimizer``)."""

from __future__ import annotations

import sys
import time

import torch

from parallel_lab.errors import one_line
from parallel_lab.plan.microbench import sync

DTENSOR_BENCH_TENSORS = 64  # enough that a per-step part, were there one, is lost in the per-tensor one


def measure_dtensor_optimizer(device: str, reps: int = 8) -> float:
    """What FSDP2's optimizer pays per parameter tensor beyond plain Adam: the runs' Adam stepped on
    ``DTENSOR_BENCH_TENSORS`` 1K-element DTensors (one-rank mesh) against the same plain tensors.

    Every elementwise operation on a DTensor goes through DTensor's dispatch (sharding propagation,
    unwrapping, rewrapping): 0.11 ms per tensor on the 2-core CI CPU for the cnn and the vit alike,
    timed around ``fully_shard`` at world 1 (docs/gpu.md), a cost that grows with the tensors, not
    their size. Measured here, not fitted on a run: fitted on the cnn's 10 tensors, the run's own
    per-step extra was priced per tensor and the vit's 71 came out 2-3x (docs/gpu.md). The two
    steps alternate and each keeps its fastest, so a slower moment of the machine falls on both.
    The group is a one-rank gloo group over an in-memory store (no port); one already open is used."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    opened = not dist.is_initialized()
    if opened:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        plain = [torch.zeros(1024, device=device) for _ in range(DTENSOR_BENCH_TENSORS)]
        # src_data_rank=None: each rank shards its own tensors, no collective (nor does Adam's
        # elementwise arithmetic issue one), so a rank of an open group may measure alone.
        shards = [distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for t in plain]
        steps = [adam_step(plain, device), adam_step(shards, device)]
        best = _alternating(steps, reps)
    finally:
        if opened:
            dist.destroy_process_group()
    return max(0.0, (best[1] - best[0]) / DTENSOR_BENCH_TENSORS)


def _alternating(steps: list, reps: int) -> list[float]:
    """Each step's fastest of ``reps`` timings, the steps taking turns (after one untimed round)."""
    for step in steps:
        step()
    times = [[step() for step in steps] for _ in range(reps)]
    return [min(column) for column in zip(*times)]


def dtensor_or_none(device: str, reps: int = 8) -> float:
    """``measure_dtensor_optimizer``, or 0 with a line on stderr where DTensor cannot be built here
    (FSDP2's optimizer is then priced by its fitted per-step part alone, as before version 4)."""
    try:
        return measure_dtensor_optimizer(device, reps)
    except (RuntimeError, ValueError, ImportError) as err:
        print(f"calibration: DTensor's optimizer cost not measured ({one_line(err)}); counted as 0", file=sys.stderr)
        return 0.0


def adam_step(tensors: list[torch.Tensor], device: str):
    """A function that times one step (seconds) of the runs' Adam over ``tensors`` as parameters
    with gradients of ones."""
    from omegaconf import OmegaConf

    from parallel_lab.config.schema import TrainerConfig
    from parallel_lab.optim import optimizer_factory

    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = optimizer_factory(OmegaConf.structured(TrainerConfig))(params)

    def step() -> float:
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        return time.perf_counter() - t0

    return step
