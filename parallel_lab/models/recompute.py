"""Activation recomputation (``trainer.recompute``): a model's blocks keep only their inputs in the
forward and recompute the rest during backward (docs/vit.md, "Recomputation").

- ``full``: each transformer block is one recomputed region (only the block's input is kept);
- ``selective``: only each block's attention core (scores, softmax, dropout, weighted sum) is
  recomputed, the part Korthikanti et al. (arXiv 2205.05198) pick: its saved tensors grow with
  tokens^2 while it costs few FLOPs to redo;
- ``none``: nothing recomputed.

The model's modules consult one shared ``Recompute`` (a plain attribute, no module: state_dict keys,
parameter names and the tensor/pipeline plans are unchanged). It is a model setting, not a
parallelism: every strategy runs the same recomputing model.

The checkpoint function is injectable: ``set_recompute(model, mode, checkpoint=fn)`` with
``fn(function, *args) -> output`` (default ``torch_checkpoint``: torch.utils.checkpoint's
non-reentrant one). ``deepspeed.checkpointing.non_reentrant_checkpoint`` has that signature.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn

NONE, SELECTIVE, FULL = "none", "selective", "full"
MODES = (NONE, SELECTIVE, FULL)  # config/schema.py's trainer.recompute offers the same

Checkpoint = Callable[..., Any]  # (function, *args) -> function(*args), recomputed in backward


def torch_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """torch.utils.checkpoint, non-reentrant: the inputs are kept through autograd's saved-tensor
    machinery (so a saved-tensors hook counts them), and the CPU/CUDA RNG state is restored
    for the recomputation."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


class Recompute:
    """A model's recompute setting, shared by its blocks: which regions are recomputed, with what
    checkpoint function. ``keys``: the model's per-sample dropout keys (models/dropout.py), put back
    as they were in the forward while a region is recomputed, so it draws the same masks even when
    other micro-batches ran their forward in between (a pipeline's 1F1B schedule)."""

    def __init__(self, mode: str = NONE, keys: Any = None, checkpoint: Checkpoint = torch_checkpoint) -> None:
        self.keys = keys
        self.checkpoint = checkpoint
        # Entered around each region's forward run (not its recomputation): the planner's count of
        # what a region saves (plan/predict.py). None in training.
        self.around: Callable[[], AbstractContextManager] | None = None
        self.set_mode(mode)

    def set_mode(self, mode: str) -> None:
        mode = getattr(mode, "value", mode)  # a Choice from a typed config
        if mode not in MODES:
            raise ValueError(f"recompute={mode} is unknown; use one of {', '.join(MODES)}")
        self.mode = mode

    def run(self, level: str, function: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        """function(*args), recomputed in backward when this is the model's mode (level: FULL or
        SELECTIVE). Plain in eval / no_grad: nothing is saved there."""
        if self.mode != level or not torch.is_grad_enabled():
            return function(*args)
        keys = None if self.keys is None else self.keys.keys
        first = [True]

        def region(*inputs: torch.Tensor) -> torch.Tensor:
            if first[0]:  # the forward itself
                first[0] = False
                with self.around() if self.around is not None else nullcontext():
                    return function(*inputs)
            return self._replay(keys, function, *inputs)

        return self.checkpoint(region, *args)

    def _replay(self, keys: Any, function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        if self.keys is None:
            return function(*inputs)
        current, self.keys.keys = self.keys.keys, keys
        try:
            return function(*inputs)
        finally:
            self.keys.keys = current


def setting_of(model: nn.Module) -> Recompute | None:
    """The model's shared Recompute (None: a model without recomputable blocks, cnn or resnet18)."""
    for module in model.modules():
        found = getattr(module, "recompute", None)
        if isinstance(found, Recompute):
            return found
    return None


def set_recompute(model: nn.Module, mode: str | None = None, checkpoint: Checkpoint | None = None) -> None:
    """Set the model's recompute mode and/or checkpoint function (the injection point: the
    DeepSpeed strategies pass DeepSpeed's non-reentrant checkpoint, strategies/zero/ds_checkpointing.py).
    A model without blocks accepts only ``none`` (config/validate.py refuses the rest in the parent)."""
    setting = setting_of(model)
    if setting is None:
        if getattr(mode, "value", mode) not in (None, NONE):
            raise ValueError(f"recompute={mode}: {type(model).__name__} has no blocks to recompute")
        return
    if mode is not None:
        setting.set_mode(mode)
    if checkpoint is not None:
        setting.checkpoint = checkpoint


@contextmanager
def recomputing(model: nn.Module, mode: str) -> Iterator[Recompute | None]:
    """The model's mode set to ``mode`` for the block (the planner counts each mode on one model)."""
    setting = setting_of(model)
    if setting is None:  # nothing to recompute here (a pipeline stage of only the head)
        yield None
        return
    before = setting.mode
    setting.set_mode(mode)
    try:
        yield setting
    finally:
        setting.mode = before
