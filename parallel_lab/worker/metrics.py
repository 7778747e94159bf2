"""Measured numbers: memory per rank, timing medians, the parameter checksum, the final parameters.

What metrics.json holds is ``parallel_lab.protocol.RunMetrics``."""

from __future__ import annotations

import hashlib
import resource
import statistics
from typing import Iterable

import torch
import torch.distributed as dist


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
