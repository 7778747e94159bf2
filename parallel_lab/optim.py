"""The optimizer of ``trainer.optimizer`` (``optimizer_factory``: strategies get a factory and build it
on their own parameters) and the learning-rate schedule of ``trainer.lr_scheduler`` (usually from a
DeepSpeed file's ``scheduler`` section): the class DeepSpeed itself would build for that name, on every strategy.

DeepSpeed's engine looks the name up in ``deepspeed.runtime.lr_schedules`` (WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle, LRRangeTest), then in ``torch.optim.lr_scheduler``, builds it on the
optimizer with the file's params and calls ``step()`` after every optimizer step. The training
loop does exactly that for every strategy (a ZeRO engine gets no scheduler of its own), so the LR
of step k is the same everywhere. Importing DeepSpeed's schedules imports DeepSpeed: only runs
with a schedule pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:  # torch-free at import: the parent's memory check reads optimizer_bytes_per_param
    import torch


def optimizer_bytes_per_param(trainer: DictConfig) -> int:
    """fp32 optimizer state per parameter: Adam/AdamW keep two moments, SGD one momentum buffer."""
    if trainer.optimizer in ("adam", "adamw"):
        return 8
    return 4 if trainer.momentum else 0


def scheduler_class(name: str) -> Any:
    """DeepSpeed's lookup: its own schedules first, then torch's; None if neither has the name."""
    import torch
    from deepspeed.runtime import lr_schedules

    if name in lr_schedules.VALID_LR_SCHEDULES and hasattr(lr_schedules, name):
        return getattr(lr_schedules, name)
    return getattr(torch.optim.lr_scheduler, name, None) if name and name[0].isupper() else None


def make_scheduler(trainer: DictConfig, optimizer: Any, first_step: int = 0) -> Any:
    """The schedule on this optimizer (a ZeRO wrapper's inner torch optimizer included), advanced
    past ``first_step`` steps already taken (a resumed run); None without trainer.lr_scheduler."""
    if not trainer.get("lr_scheduler"):
        return None
    import logging

    params = OmegaConf.to_container(trainer.lr_scheduler_params, resolve=True) or {}
    logger, level = logging.getLogger("DeepSpeed"), logging.getLogger("DeepSpeed").level
    logger.setLevel(logging.ERROR)  # WarmupLR warns "before it has started" at every construction
    try:
        scheduler = scheduler_class(trainer.lr_scheduler)(optimizer, **params)
    finally:
        logger.setLevel(level)
    for _ in range(first_step):  # the same calls a run from step 0 made, whatever the schedule
        scheduler.step()
    return scheduler


def optimizer_factory(trainer: DictConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    import torch

    def make(params):
        if trainer.optimizer == "sgd":
            return torch.optim.SGD(params, lr=trainer.lr, momentum=trainer.momentum, weight_decay=trainer.weight_decay)
        # foreach=False: the same per-tensor kernels whatever the wrapping, so sharded and
        # replicated runs do bit-comparable updates. adamw: decoupled weight decay (DeepSpeed's
        # config "Adam" by default, adam_w_mode=true).
        adam = torch.optim.AdamW if trainer.optimizer == "adamw" else torch.optim.Adam
        betas = tuple(trainer.get("betas", (0.9, 0.999)))
        eps = trainer.get("eps", 1e-8)
        return adam(params, lr=trainer.lr, betas=betas, eps=eps, weight_decay=trainer.weight_decay, foreach=False)

    return make
