"""Bytes of model state: what a rank really holds (measured) and what the textbook says (analytic).

``Memory`` is the part of a running strategy that accounts for them (``Strategy.memory``); the
helpers below are shared by its implementations. A DTensor counts its local shard only, so tensor-
and sequence-parallel layouts are measured the same way as plain tensors.
"""

from __future__ import annotations

import abc
from typing import Iterable

import torch
from omegaconf import DictConfig

from parallel_lab.optim import optimizer_bytes_per_param
from parallel_lab.strategies.part import Part


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


class Memory(Part, abc.ABC):
    """What this rank holds, measured from the real tensors, beside the textbook value. The loop
    measures twice on the last step and merges the two (disjoint) reports: gradients exist only
    until the optimizer step frees or zeroes them, optimizer state only from the first optimizer
    step on. No measurement may issue a collective or touch a value. No default (``@register``
    refuses a strategy without one): a sharded strategy must not report full-model memory."""

    @abc.abstractmethod
    def after_backward(self) -> dict[str, int]:
        """Bytes of parameters and gradients (param_bytes, grad_bytes, ...) this rank holds after
        the last backward, before the optimizer step."""

    @abc.abstractmethod
    def after_step(self) -> dict[str, int]:
        """Bytes of optimizer state (optim_bytes, ...) this rank holds after the last optimizer step."""

    @abc.abstractmethod
    def analytic(self, num_params: int) -> dict[str, int]:
        """What the textbook says this rank should hold (ZeRO paper, arXiv 1910.02054), same keys."""

    def buffers(self) -> dict[str, int]:
        """Bytes of the model's buffers (BatchNorm's running statistics) this rank holds."""
        return {"buffer_bytes": sum(b.numel() * b.element_size() for b in self.model.buffers())}


class HeldMemory(Memory):
    """Parameters, gradients and optimizer state as plain (or DTensor) tensors of this rank's model:
    a replica, a pipeline stage, a tensor-parallel rank's slices."""

    def after_backward(self) -> dict[str, int]:
        return held_param_grad_bytes(self.model)

    def after_step(self) -> dict[str, int]:
        return held_optimizer_bytes(self.optimizer)


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
