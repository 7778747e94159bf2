"""Expert parallelism applied to a single-device model (torchtitan's "parallelize" step): each MoE
layer keeps only this rank's E / ep experts and dispatches through the ep group's all-to-all
(dispatch.py). The dense parameters stay with the data-parallel wrapper (DDP's all-reduce, FSDP's
shards); the experts' gradients are reduced here: every expert saw tokens from the whole ep group,
so its gradient is already summed over the group's micro-batches; summing over the ranks holding
the same expert (groups.py ``replica_ranks``) and dividing by the dp size gives the gradient of
the global batch's mean loss, as the dense gradients' average does (DeepSpeed's expert-data-parallel
group, torchtitan's dp_mod_ep)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab.comm.counter import CommCounter
from parallel_lab.models.moe import moe_layers
from parallel_lab.strategies.ep.dispatch import ExpertDispatch, Traffic
from parallel_lab.strategies.ep.groups import all_groups, ep_group_ranks, ep_rank, replica_ranks
from parallel_lab.strategies.mesh import MeshDims

EP_LABEL, REPLICA_LABEL = "ep", "ep_replicas"  # the counter's names of the two groups


def _my_group(dims: MeshDims, rank: int, kind, timeout: timedelta, counter: CommCounter, label: str):
    """Create every group of this kind (collective: each rank creates all, in one order); this rank's."""
    mine = None
    for ranks in all_groups(dims, kind):
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
            counter.label_group(group, label)
    return mine


class ExpertParallel:
    """A model's MoE layers sharded over the ep group of ``rank`` (built collectively)."""

    def __init__(self, model: nn.Module, dims: MeshDims, rank: int, timeout_s: int, counter: CommCounter) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.dims, self.rank = dims, rank
        self.group = _my_group(dims, rank, ep_group_ranks, timeout, counter, EP_LABEL)
        self.replicas = _my_group(dims, rank, replica_ranks, timeout, counter, REPLICA_LABEL)
        self.traffic = Traffic()
        self.layers = moe_layers(model)
        share = ep_rank(dims, rank)
        for moe in self.layers:
            local = moe.num_experts // dims.ep
            moe.experts = nn.ModuleList(list(moe.experts)[share * local : (share + 1) * local])
            moe.dispatch = ExpertDispatch(self.group, dims.ep, share, self.traffic)

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for moe in self.layers for p in moe.experts.parameters()]

    def expert_names(self, model: nn.Module) -> list[str]:
        """Qualified names of the expert parameters in ``model`` (what DDP must leave alone)."""
        mine = {id(p) for p in self.expert_parameters()}
        return [name for name, p in model.named_parameters() if id(p) in mine]

    def reduce_gradients(self) -> None:
        """Each expert gradient summed over the expert's replicas, then / dp (module docstring)."""
        grads = [p.grad for p in self.expert_parameters() if p.grad is not None]
        if not grads:
            self.traffic.steps += 1
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if len(replica_ranks(self.dims, self.rank)) > 1:
            dist.all_reduce(flat, group=self.replicas)
        flat /= self.dims.data_parallel_size
        self.traffic.steps += 1
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def full_parameters(self, model: nn.Module, whole=lambda p: p.detach()) -> list[torch.Tensor]:
        """Every parameter of the single model in its order, each MoE layer's experts gathered from
        its ep group (collective); ``whole(p)``: a dense parameter whole (FSDP: gathered)."""
        first = {id(next(moe.experts.parameters())): moe for moe in self.layers}
        return in_single_order(model, first, {id(p) for p in self.expert_parameters()}, self._gather, whole)

    def _gather(self, moe) -> list[torch.Tensor]:
        """All experts' parameters, expert by expert, from the ranks of the ep group."""
        local = [p.detach() for p in moe.experts.parameters()]
        flat = torch.cat([t.reshape(-1) for t in local])
        gathered = flat.new_empty(self.dims.ep * flat.numel())
        dist.all_gather_single(gathered, flat, group=self.group)
        gathered = gathered.view(self.dims.ep, -1)
        per_expert = len(local) // len(moe.experts)
        out = []
        for block in gathered:
            offset = 0
            for t in local:
                out.append(block[offset : offset + t.numel()].view_as(t).clone())
                offset += t.numel()
        assert len(out) == per_expert * moe.num_experts
        return out

    def theory_bytes_per_step(self) -> dict[str, float]:
        """The exchanges' bytes per training step this rank's routing implies (dispatch.Traffic)."""
        steps = max(1, self.traffic.steps)
        return {op: n / steps for op, n in self.traffic.as_dict().items()}

    def metrics(self) -> dict:
        """metrics.json's ``strategy_extras.ep``: the degree and the routing's bytes per step in theory."""
        return {"ep": {"degree": self.dims.ep, "theory_bytes_per_step": self.theory_bytes_per_step()}}


def expert_parallel(strategy, model: nn.Module) -> ExpertParallel | None:
    """The strategy's experts sharded over its ep groups (collective), None at strategy.ep=1."""
    if strategy.layout.ep == 1:
        return None
    return ExpertParallel(model, strategy.layout, strategy.env.rank, strategy.cfg.dist_timeout_s, strategy.comm)


def in_single_order(model: nn.Module, first: dict, held: set[int], gather, whole) -> list[torch.Tensor]:
    """The single model's parameters in its order from a rank holding a share of the experts:
    ``first`` maps the id of a layer's first local expert parameter to the layer, where ``gather(layer)``
    puts every expert's parameters (all ep ranks'); ``held`` are the local experts' ids, left out;
    every other parameter is ``whole(p)``."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        if id(p) in first:
            out += gather(first[id(p)])
        if id(p) not in held:
            out.append(whole(p))
    return out
