"""Does a run fit this machine? Checked in the parent (``config.validate``), before any worker starts.

Memory: every rank is its own Python process holding torch, the whole dataset, a model replica and
its activations, so world_size ranks need world_size times one rank's share. A run that cannot fit
is refused with the figures: too many ranks used to swap for minutes without a line of output.
CPU: more threads than cores still works, only slowly, so that is a one-line warning.

The estimate, per rank (host memory, as on CPU; sharded strategies and CUDA runs hold less), from
model.* alone (models/counts.py: the parent imports no torch for it):
  WORKER_RUNTIME_BYTES (Python, torch and this package, torch kernels paged in, gloo, the process group)
  + DATA_PEAK_FACTOR x the dataset's float bytes (each rank loads the whole set)
  + model state: 4 bytes/param of weights + 4 of gradients + the optimizer's state (Adam 8, SGD 4)
  + ACTIVATION_FACTOR x the model's saved-for-backward bytes per sample x the per-rank micro-batch.
Against ranks[k].peak_rss_bytes of `python -m parallel_lab strategy=ddp trainer.steps=3` (2 ranks,
data.size=4096, torch 2.13 CPU, parent at 231 MiB) it errs high by 5-10%:
  cnn,      micro-batch 32: estimate 491 MiB, measured 455;  micro-batch 1: 477 vs 455
  resnet18, micro-batch 32: estimate 829 MiB, measured 769-781;  micro-batch 1: 648 vs 592-595
zero0-3 workers also import DeepSpeed (+70 MiB measured: cnn zero2 525 MiB), 6% above the estimate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError, Warn, print_warning

MIB, GIB = 2**20, 2**30
MEMINFO = Path("/proc/meminfo")
SELF_STATUS = Path("/proc/self/status")
# A ddp cnn worker with data.size=64 and a micro-batch of 1 (data, model and activations 9 MiB)
# peaked at 333 MiB (torch 2.13's CPU wheel): the rest is the worker's own runtime.
WORKER_RUNTIME_BYTES = 324 * MIB
# Loading keeps about three float copies of the training images alive at once (synthetic: the class
# prototypes per sample, the noise and their sum; cifar10: the images, minus MEAN, divided by STD).
# Measured peaks over the images' float bytes: synthetic 148 MiB / 54 MiB, cifar10 1937 / 703 MiB.
DATA_PEAK_FACTOR = 2.75
# Backward holds the gradient of the layer it is in beside the saved tensors: the peak RSS of a
# resnet18 ddp worker rose 5.9 MiB per sample of micro-batch, 1.3x its 4.5 MiB saved per sample.
ACTIVATION_FACTOR = 1.3
OVERSUBSCRIBED = 2  # threads per core above which every step waits on ranks taking turns: warn


@dataclass
class RankMemory:
    """One rank's estimated peak host memory, in bytes, by what holds it."""

    runtime: int
    data: int
    model_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.runtime + self.data + self.model_state + self.activations

    def describe(self) -> str:
        parts = {
            "python+torch": self.runtime,
            "data": self.data,
            "model state": self.model_state,
            "activations": self.activations,
        }
        return "MiB: " + ", ".join(f"{v / MIB:.0f} {k}" for k, v in parts.items())


def _proc_bytes(path: Path, key: str) -> int | None:
    """A 'Key:   123 kB' line of a /proc file in bytes, or None where there is no such file or line."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    return None


def memory_available_bytes() -> int | None:
    """What the kernel says new processes can use without swapping (None off Linux)."""
    return _proc_bytes(MEMINFO, "MemAvailable")


def estimate_rank_memory(cfg: DictConfig, micro_batch: int) -> RankMemory | None:
    """One rank's peak host memory for this validated config (None where /proc is missing)."""
    from parallel_lab.data import dataset_bytes
    from parallel_lab.models.counts import activation_bytes_per_sample, param_count
    from parallel_lab.optim import optimizer_bytes_per_param

    if _proc_bytes(SELF_STATUS, "VmRSS") is None:
        return None
    return RankMemory(
        runtime=WORKER_RUNTIME_BYTES,
        data=int(DATA_PEAK_FACTOR * dataset_bytes(cfg.data)),
        model_state=param_count(cfg.model) * (4 + 4 + optimizer_bytes_per_param(cfg.trainer)),
        activations=int(ACTIVATION_FACTOR * activation_bytes_per_sample(cfg.model) * micro_batch),
    )


def check_memory(cfg: DictConfig, micro_batch: int) -> None:
    """Refuse a run whose ranks together need more memory than the machine has available."""
    available = memory_available_bytes()
    per_rank = estimate_rank_memory(cfg, micro_batch)
    if available is None or per_rank is None:
        return  # cannot tell here: go on, as before this check existed
    ranks = cfg.world_size
    need = ranks * per_rank.total
    if need <= available:
        return
    fits = available // per_rank.total
    fix = f"use world_size <= {fits}" if fits else "free memory, or lower data.size, trainer.global_batch or the model"
    raise ConfigError(
        f"world_size={ranks} needs about {ranks} x {per_rank.total / GIB:.2f} GiB = {need / GIB:.1f} GiB of "
        f"memory (per rank, {per_rank.describe()}), this machine has {available / GIB:.1f} GiB available; {fix}"
    )


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order ([] where the OS cannot say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def cpu_cores() -> int:
    """Cores this process may run on (its affinity, which containers and taskset narrow)."""
    return len(allowed_cores()) or os.cpu_count() or 1


def pin_to_cores(local_rank: int, threads: int) -> None:
    """trainer.pin_cores: bind this process to the ``local_rank``-th group of ``threads`` cores among
    those it may use. Where that group does not exist (a launcher already bound each rank to fewer
    cores) nothing changes. Call it before the process starts threads of its own: they inherit it."""
    group = allowed_cores()[local_rank * threads : (local_rank + 1) * threads]
    if len(group) == threads:
        os.sched_setaffinity(0, group)


def check_pinning_fits(cfg: DictConfig) -> None:
    """trainer.pin_cores=true with more threads on a host than cores: refused, naming the figures."""
    if not cfg.trainer.pin_cores or cfg.device == "cuda":
        return
    per_host = cfg.launcher.nproc_per_node or cfg.world_size
    cores, threads = cpu_cores(), cfg.trainer.threads
    if per_host * threads > cores:
        raise ConfigError(
            f"trainer.pin_cores=true needs {per_host} ranks per host x trainer.threads={threads} = "
            f"{per_host * threads} cores, this machine allows {cores}; use trainer.pin_cores=false, or at most "
            f"{max(1, cores // threads)} ranks per host"
        )


def warn_if_oversubscribed(cfg: DictConfig, warn: Warn = print_warning) -> None:
    """A run with far more threads than cores works, but its timings mean little: say so once."""
    cores, threads = cpu_cores(), cfg.world_size * cfg.trainer.threads
    if threads > OVERSUBSCRIBED * cores:
        warn(
            f"world_size={cfg.world_size} x trainer.threads={cfg.trainer.threads} = {threads} threads on "
            f"{cores} CPU cores: each step will take about {threads / cores:.3g}x as long as with a core per "
            f"thread; for meaningful timings keep world_size x trainer.threads <= {cores}"
        )


def check_machine_fits(cfg: DictConfig, micro_batch: int, warn: Warn = print_warning) -> None:
    """Refuse a run the memory cannot hold; warn about one the cores can only time-slice."""
    check_memory(cfg, micro_batch)
    check_pinning_fits(cfg)
    warn_if_oversubscribed(cfg, warn)
