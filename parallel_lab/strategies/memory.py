"""Bytes of model state: what a rank really holds (measured) and what the textbook says (analytic).

Shared by the strategies' ``memory_after_backward``/``memory_after_step``/``analytic_memory``. A
DTensor counts its local shard only, so tensor- and sequence-parallel layouts are measured the same
way as plain tensors.
"""

from __future__ import annotations

from typing import Iterable

import torch
from omegaconf import DictConfig


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank stores: a DTensor's local shard, or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind tensors: views into one flat buffer count once, and
    the whole buffer counts (padding included), freed storages (resized to 0) count nothing.
    This is what sharded strategies hold for real, whatever views they hand out."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return int(sum(seen.values()))


def optimizer_bytes_per_param(trainer: DictConfig) -> int:
    """fp32 optimizer state per parameter: Adam/AdamW keep two moments, SGD one momentum buffer."""
    if trainer.optimizer in ("adam", "adamw"):
        return 8
    return 4 if trainer.momentum else 0


def held_param_grad_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Parameters and gradients this rank stores now (a DTensor: its local shard)."""
    params = list(model.parameters())
    return {
        "param_bytes": tensor_bytes(local_tensor(p) for p in params),
        "grad_bytes": tensor_bytes(local_tensor(p.grad) for p in params if p.grad is not None),
    }


def held_optimizer_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Every optimizer state tensor this rank stores (a DTensor state: its shard); empty before the
    first step."""
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]
    return {"optim_bytes": tensor_bytes(local_tensor(v) for v in state)}


def analytic_state_bytes(numel: int, trainer: DictConfig) -> dict[str, int]:
    """The ZeRO paper's per-rank model states (arXiv 1910.02054, fp32) for numel parameters held
    whole: 4 bytes/param of weights, 4 of gradients and the optimizer's state (Adam 8, SGD 4)."""
    return {
        "param_bytes": 4 * numel,
        "grad_bytes": 4 * numel,
        "optim_bytes": optimizer_bytes_per_param(trainer) * numel,
    }


# ----- prediction (parallel_lab.plan): the same quantities, from shapes alone -----
def param_numels(model: torch.nn.Module) -> list[int]:
    """Element count of every parameter in model order (works on the meta device)."""
    return [p.numel() for p in model.parameters()]


def predicted_optimizer_bytes(numels: Iterable[int], trainer: DictConfig, *, step_counters: bool) -> int:
    """Optimizer state torch creates for tensors of these sizes: Adam's two fp32 moments (and,
    step_counters=True, its fp32 scalar step tensor per parameter, which the replicated
    measurement counts); SGD one momentum buffer when momentum > 0."""
    numels = list(numels)
    total = optimizer_bytes_per_param(trainer) * sum(numels)
    if trainer.optimizer == "adam" and step_counters:
        total += 4 * len(numels)
    return int(total)


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk's split of ``rows`` into ``world`` parts (the layout FSDP2 and our tp use):
    (rows rank holds, rows every rank's padded shard has). Chunks are ceil(rows / world) long, so
    high ranks may get fewer rows or none."""
    per = -(-rows // world)
    return max(0, min(rows, (rank + 1) * per) - rank * per), per
