"""``State``: where a running strategy's model and optimizer state lives: how it is saved, loaded
(its own checkpoints, or a strategy-neutral full state: ``trainer.reshard``, ``trainer.init_from``)
and gathered whole for the parity check. ``checkpoint/`` owns atomicity and the barriers.

No default: a sharded strategy that inherited a replicated one would save only rank 0's shard
without a word, so ``@register`` refuses a strategy whose ``State`` leaves one of these abstract
(``ReplicatedState`` in ``replicated.py`` for strategies whose every rank holds all of it,
``RankShardState`` in ``rank_shards.py`` for one file per rank)."""

from __future__ import annotations

import abc
from pathlib import Path

import torch

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.part import Part


class State(Part, abc.ABC):
    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write this rank's part of the model and optimizer state into directory."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what save wrote (collective where saving was)."""

    @abc.abstractmethod
    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter of the full (unsharded) model in the single model's order; collective."""

    def load_full(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, dict]) -> None:
        """Scatter a strategy-neutral full state (``checkpoint/full_state.py``: the single model's
        state_dict, Adam's state by parameter name) into this strategy's own layout; collective
        where setup was. Used by ``trainer.reshard=true``; a strategy without it cannot be resharded into."""
        raise ConfigError(
            f"strategy={self.cfg.strategy.name} cannot load a resharded checkpoint; resume it with "
            f"its own strategy and world size (drop trainer.reshard=true)"
        )

    def load_resharded_natively(self, directory: Path, fmt: str) -> bool:
        """Load a checkpoint of another layout with a library's own resharding when one applies to
        its format (FSDP: DCP's load-time resharding of a DCP checkpoint); False: not handled here,
        the full state is scattered by load_full instead."""
        return False
