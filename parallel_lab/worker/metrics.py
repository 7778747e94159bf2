"""Measured numbers: memory per rank, timing medians, the parameter checksum, the final parameters,
the machine's load and clock, the model's FLOPs per step and the machine's own peak FLOP/s.

What metrics.json holds is ``parallel_lab.protocol.RunMetrics``."""

from __future__ import annotations

import functools
import hashlib
import math
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel_lab.models import build_meta_model
from parallel_lab.models.flops import flops_by_kind
from parallel_lab.threads import torch_threads


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def param_checksum(params: Iterable[torch.Tensor]) -> float:
    """Sum of every parameter element in float64: equal runs give equal checksums."""
    return float(sum(p.detach().double().sum().item() for p in params))


def param_sha256(params: Iterable[torch.Tensor]) -> str:
    """sha256 of every parameter's raw bytes in order: equal only for bitwise-identical weights."""
    digest = hashlib.sha256()
    for p in params:
        flat = p.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def timed_median(values: list[float], warmup: int) -> float:
    kept = values[warmup:] if len(values) > warmup else values
    return statistics.median(kept)


def gather_from_ranks(item: dict) -> list[dict]:
    """Every rank's dict, in rank order (one-element list when there is no process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [item]
    items: list = [None] * dist.get_world_size()
    dist.all_gather_object(items, item)
    return items


def cpu_mhz() -> float | None:
    """The CPUs' mean current clock in MHz: cpufreq's scaling_cur_freq where the kernel exposes it,
    else /proc/cpuinfo's "cpu MHz" lines; None where neither exists (a VM may show neither)."""
    sysfs = sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"))
    try:
        if sysfs:
            return statistics.mean(int(p.read_text()) / 1000 for p in sysfs)  # kHz
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    mhz = [float(line.split(":")[1]) for line in lines if line.startswith("cpu MHz")]
    return statistics.mean(mhz) if mhz else None


def machine_state() -> dict:
    """What the machine was doing (metrics.json's ``machine``, at the run's start and end): the
    1/5/15-minute load averages and the CPU clock, so a slow row can be told from a busy machine."""
    return {"loadavg": list(os.getloadavg()), "cpu_mhz": cpu_mhz()}


FWD_BWD = 3  # model FLOPs of a training step: forward + backward (twice the forward: input and weight grads)


def model_flops_by_kind(model_cfg: DictConfig, global_batch: int) -> dict[str, float]:
    """The model FLOPs of one optimizer step on the global batch, by the kernel that runs them
    ({"conv", "matmul"}: what MFU's peak is weighted by, report/timing.py blended_peak): the forward
    count of every Conv2d/Linear/attention matmul (models/flops.py, 2 FLOPs per multiply-add) x
    FWD_BWD; what a strategy recomputes or adds (communication, the optimizer) is not model work and
    not counted."""
    return dict(_model_flops(OmegaConf.to_yaml(model_cfg, resolve=True), global_batch))


# A meta forward runs torch's Python meta kernels op by op (0.1-0.3 s for the vit, py-spy), once per
# run and rank; a process that trains many runs of one model in turn (the suite's shared rank sets)
# counts it once. Keyed by the model config's resolved text: the count is a pure function of it.
@functools.lru_cache(maxsize=32)
def _model_flops(model_yaml: str, global_batch: int) -> tuple[tuple[str, float], ...]:
    meta = build_meta_model(OmegaConf.create(model_yaml))
    return tuple((k, FWD_BWD * v) for k, v in flops_by_kind(meta, global_batch).items())


def model_flops_per_step(model_cfg: DictConfig, global_batch: int) -> float:
    """model_flops_by_kind's total (one meta forward: a run records both from one call)."""
    return sum(model_flops_by_kind(model_cfg, global_batch).values())


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEAK_BUDGET_S = 0.2  # per kernel: the best of ~0.2 s of calls; a sweep measures each (dtype, threads) once


def _best_gflops(fn, flops: float, device: torch.device) -> float:
    """flops / the fastest of repeated calls, after one warm-up call, for PEAK_BUDGET_S."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    fn()
    sync(device)
    best, spent = math.inf, 0.0
    while spent < PEAK_BUDGET_S or best == math.inf:
        start = time.perf_counter()
        fn()
        sync(device)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return flops / best / 1e9


def measure_peak(dtype: str = "fp32", threads: int = 1, device: str = "cpu") -> dict:
    """This machine's own peak GFLOP/s in the run's compute dtype with a rank's thread count (CPU)
    or on the GPU: the better of a square matmul and a 3x3 convolution, each sized to run at full
    speed (what MFU divides by). Returns both kernels' rates and the peak."""
    dev, dt = torch.device(device), DTYPES[dtype]
    cuda = dev.type == "cuda"
    n, (b, c, hw) = (8192, (64, 256, 56)) if cuda else (512, (8, 64, 32))
    with torch_threads(None if cuda else threads):
        x, y = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
        img, w = torch.randn(b, c, hw, hw, device=dev, dtype=dt), torch.randn(c, c, 3, 3, device=dev, dtype=dt)
        with torch.no_grad():
            matmul = _best_gflops(lambda: x @ y, 2.0 * n**3, dev)
            conv = _best_gflops(
                lambda: torch.nn.functional.conv2d(img, w, padding=1), 2.0 * b * c * hw * hw * c * 9, dev
            )
    name = torch.cuda.get_device_name(dev) if cuda else None
    return dict(
        device=device,
        device_name=name,
        dtype=dtype,
        threads=threads,
        matmul_gflops=matmul,
        conv_gflops=conv,
        peak_gflops=max(matmul, conv),
    )


def peaks_for(wanted: set[tuple[str, str, int]]) -> list[dict]:
    """measure_peak once per (device, dtype, threads) wanted. A CPU rank with t threads can always
    reach what one of them reaches, so its peak is never below the same dtype's one-thread figure:
    on a shared machine a t-thread kernel waits at every barrier for its slowest thread and can
    measure far below it (then ``peak_from`` says so)."""
    measured: dict[tuple, dict] = {}

    def peak(device: str, dtype: str, threads: int) -> dict:
        if (device, dtype, threads) not in measured:
            measured[device, dtype, threads] = measure_peak(dtype, threads, device)
        return measured[device, dtype, threads]

    out = []
    for device, dtype, threads in sorted(wanted):
        p = dict(peak(device, dtype, threads), peak_from=f"{threads} thread{'s' * (threads > 1)}")
        one = peak(device, dtype, 1) if device == "cpu" and threads > 1 else p
        if one["peak_gflops"] > p["peak_gflops"]:
            p.update(peak_gflops=one["peak_gflops"], peak_from="1 thread (above this thread count's own)")
        out.append(p)
    return out


def rank0_planned_psi(cfg: DictConfig, rank: int, strategy_cls: type, num_params: int) -> float | None:
    """metrics.json's ``comm_planned_psi`` on rank 0 (the rank that writes it; None elsewhere): the
    planner's bytes in Ψ, computed where torch is loaded anyway, so the report need not build the
    meta model and the planner's pipeline in its own process."""
    if rank != 0:
        return None
    from parallel_lab.plan.predict import planned_comm_psi

    return planned_comm_psi(cfg, strategy_cls, build_meta_model(cfg.model), num_params)


def mesh_metrics(dims: dict[str, int], ranks: list[dict]) -> dict:
    """The mesh and, per dimension, the bytes per step the busiest rank issued on its group of
    that dimension: on several hosts, "replicate" is what crosses between them."""
    by_dim = {name: max(r["comm_bytes_by_group"].get(name, 0.0) for r in ranks) for name in dims}
    return {"dims": dims, "comm_bytes_per_step": by_dim}
