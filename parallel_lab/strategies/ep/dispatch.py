"""An MoE layer's dispatch across the ranks of its ep group (models/moe.py calls it with the
token copies sorted by expert and the count per expert): three exchanges per forward, as GShard's
dispatch and combine (arXiv 2006.16668, section 2.2), with uneven splits instead of its padded
E x C buffer (dropless):

1. the counts: an all-gather of every rank's count per expert (E integers each), so that each
   rank knows how many rows it sends to and receives from every other;
2. dispatch: an all-to-all of the copies to the ranks holding their experts;
3. the local experts on what arrived (ordered by expert), then combine: the all-to-all back.

Backward runs both all-to-alls again with the splits swapped (comm.AllToAll). ``Traffic`` keeps
the theory of the bytes from the routing itself: this rank sends each of its kept copies (h
elements) once forward (dispatch) and once backward (combine's gradient) and each copy its experts
received once forward (combine) and once backward (dispatch's gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab.models.moe import run_experts
from parallel_lab.strategies.ep.comm import all_to_all


@dataclass
class Traffic:
    """Bytes per rank the routing implies, summed over the training forwards (backward included)."""

    all_to_all: int = 0  # 2 x (sent + received copies) x h x element size, per forward with grad
    all_gather_single: int = 0  # the counts: ep x E x 8 bytes per forward
    steps: int = 0  # optimizer steps the bytes were summed over

    def as_dict(self) -> dict[str, int]:
        return {"all_to_all_single": self.all_to_all, "all_gather_single": self.all_gather_single}


class ExpertDispatch:
    """The ``dispatch`` of one MoE layer whose experts are sharded over ``group`` (``ep`` ranks,
    this one ``ep_rank``-th, holding experts ep_rank * L ... (ep_rank + 1) * L - 1)."""

    def __init__(self, group, ep: int, ep_rank: int, traffic: Traffic) -> None:
        self.group, self.ep, self.ep_rank, self.traffic = group, ep, ep_rank, traffic

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
        local = len(experts)
        table = self._table(counts).view(self.ep, -1)  # [source rank, expert]
        send = counts.view(self.ep, local).sum(1).tolist()  # to each rank: the copies for its experts
        mine = table[:, self.ep_rank * local : (self.ep_rank + 1) * local]  # [source, my expert]
        recv = mine.sum(1).tolist()
        arrived = self._exchange(tokens, recv, send)
        # rows arrive by source, each source's by expert: run each local expert on all of its rows
        repeats = mine.reshape(-1).to(tokens.device)
        expert_of_row = (
            torch.arange(local, device=tokens.device).repeat(self.ep).repeat_interleave(repeats, output_size=sum(recv))
        )
        order = torch.argsort(expert_of_row, stable=True)
        done = run_experts(arrived[order], mine.sum(0), experts)
        back = torch.zeros_like(done).index_copy(0, order, done)  # the rows in the order they arrived
        self._count(tokens, sum(send), sum(recv), table)
        return self._exchange(back, send, recv)

    def _table(self, counts: torch.Tensor) -> torch.Tensor:
        """Every ep rank's count per expert, flat (gloo gathers into a flat tensor)."""
        table = counts.new_empty(self.ep * counts.numel())
        dist.all_gather_single(table, counts.contiguous(), group=self.group)
        return table

    def _exchange(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        return all_to_all(x, output_splits, input_splits, self.group)

    def _count(self, tokens: torch.Tensor, sent: int, received: int, table: torch.Tensor) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward, and not a training step
            return
        row = tokens.shape[1] * tokens.element_size()
        self.traffic.all_to_all += 2 * (sent + received) * row
        self.traffic.all_gather_single += table.numel() * table.element_size()


class PlannedDispatch(ExpertDispatch):
    """ExpertDispatch on the meta device for the planner (``ep/rules.py`` ``expert_parallel_meta``):
    every ep rank routes as this one does (the meta routing's equal share, models/moe.py), the
    exchanges only shape their outputs (``comm.PlannedExchange``: autograd saves what the real one
    saves), and nothing is counted."""

    def __init__(self, ep: int, ep_rank: int) -> None:
        super().__init__(None, ep, ep_rank, Traffic())

    def _table(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.repeat(self.ep)

    def _exchange(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        from parallel_lab.strategies.ep.comm import PlannedExchange

        return PlannedExchange.apply(x, sum(output_splits))

    def _count(self, *args) -> None:
        return None
