"""``Part``: one concern of a running strategy, bound to it (``Strategy.state``: where the model
state lives; ``Strategy.memory``: what it holds; ``Strategy.norm``: what it does to BatchNorm).

A part reads the strategy it belongs to (its model, optimizer, options) and nothing else; the
strategy builds one of each in its constructor from its class attributes ``State``, ``Memory``
and ``Norm``, so a strategy file says which implementation of each concern it runs.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig


class Part:
    """What every part reads of the strategy it belongs to."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    @property
    def model(self) -> torch.nn.Module:
        return self.strategy.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def cfg(self) -> DictConfig:
        return self.strategy.cfg

    @property
    def opts(self) -> DictConfig:
        return self.strategy.opts

    @property
    def env(self):
        return self.strategy.env

    @property
    def device(self) -> torch.device:
        return self.strategy.device
