"""Gradient clipping by the norm of the whole model's gradient when each rank holds part of it."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from parallel_lab.strategies.memory import local_tensor


def clip_by_global_norm(
    split: Iterable[torch.Tensor], whole: Iterable[torch.Tensor], max_norm: float, device: torch.device, group=None
) -> None:
    """Scale every gradient by min(1, max_norm / ||g||), ||g|| over the full model: the squares of
    the ``split`` gradients (a different part on every rank of ``group``) are summed over the group,
    the ``whole`` ones (identical on every rank) are counted once. Float64 sums, as
    ``clip_grad_norm_`` would do on one device."""
    split, whole = list(split), list(whole)
    split_sq = torch.zeros((), dtype=torch.float64, device=device)
    whole_sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in split:
        split_sq += local_tensor(g).double().pow(2).sum()
    for g in whole:
        whole_sq += local_tensor(g).double().pow(2).sum()
    dist.all_reduce(split_sq, group=group)
    coef = torch.clamp(max_norm / ((split_sq + whole_sq).sqrt() + 1e-6), max=1.0)
    for g in split + whole:
        g.mul_(coef.to(local_tensor(g).dtype))
