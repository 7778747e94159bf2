"""``pp``'s checkpoint state (``PPState``: one file per rank, the stages gathered in model order)
and memory report (``PPMemory``: a rank holds its stage only), used by ``strategy.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel_lab.strategies.memory import HeldMemory, analytic_state_bytes
from parallel_lab.strategies.pp.tensor import gathered_stage, local_part
from parallel_lab.strategies.rank_shards import RankShardState


class PPState(RankShardState):
    """One file per rank; the stages' parameters (tp shards gathered along their split dimension)
    gathered to every rank in model order."""

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return local_part(self.strategy, name, full)

    def full_parameters(self) -> list[torch.Tensor]:
        """Every stage's parameters, gathered to every rank in model order (an interleaved rank's
        chunks are not contiguous: ordered by name, in the full model's order); a stage split over
        tp first gathers its shards, and the first pipeline's ranks (tp apart) hold the stages."""
        per_rank: list = [None] * self.env.world_size
        dist.all_gather_object(per_rank, gathered_stage(self.strategy))
        pairs = [pair for r in self.strategy.layout.group_ranks(0, "pp") for pair in per_rank[r]]
        order = self.strategy.chunk_order
        kept: dict[str, torch.Tensor] = {}
        for name, p in sorted(pairs, key=lambda pair: order(pair[0].split(".")[0])):
            kept.setdefault(name, p)  # a tied pipeline's last stage's copy of the embedding: the first's kept
        return list(kept.values())


class PPMemory(HeldMemory):  # the model here is this stage only
    def analytic(self, num_params: int) -> dict[str, int]:
        """Textbook: each rank holds its stage's weights, gradients and optimizer state only."""
        return analytic_state_bytes(sum(p.numel() for p in self.model.parameters()), self.cfg.trainer)
