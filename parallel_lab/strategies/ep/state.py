"""The model state of a data-parallel strategy under expert parallelism: the dense parameters are
the same on every rank, the experts differ between the ranks of an ep group. So each rank writes
and reads its own file (``RankShardState``), and the full parameters gather each MoE layer's
experts from the ep group; without ep (``strategy.ep=1``) it is ``ReplicatedState``."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel_lab.strategies.rank_shards import RankShardState
from parallel_lab.strategies.replicated import ReplicatedState


class ExpertShardedState(ReplicatedState):
    @property
    def experts(self):
        """The strategy's ``ExpertParallel`` (strategies/ep/parallel.py), None without ep."""
        return getattr(self.strategy, "experts", None)

    def save(self, directory: Path) -> None:
        if self.experts is None:
            return super().save(directory)
        RankShardState.save(self, directory)

    def load(self, directory: Path) -> None:
        if self.experts is None:
            return super().load(directory)
        RankShardState.load(self, directory)

    def _shard_file(self, directory: Path) -> Path:
        return RankShardState._shard_file(self, directory)

    def _load_local(self, state: dict, directory) -> None:
        RankShardState._load_local(self, state, directory)

    def full_parameters(self) -> list[torch.Tensor]:
        if self.experts is None:
            return super().full_parameters()
        return self.experts.full_parameters(self.unwrapped_model())
