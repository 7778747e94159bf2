"""Expert parallelism under ``zero0``..``zero2``: the model's MoE MLPs (models/moe.py) swapped for
DeepSpeed's own layer, ``deepspeed.moe.layer.MoE`` (DeepSpeed-MoE, Rajbhandari et al., arXiv
2201.05596; its gate and all-to-all follow GShard, Lepikhin et al., arXiv 2006.16668), holding
the same router and expert weights, so that the run is judged against ``single`` as every other
strategy is. The swap is the strategy's parallelize step; the model itself knows nothing of it.

How the layer is configured, and why (docs/moe.md):

- ``k`` = ``model.moe_topk`` (1 or 2: DeepSpeed's layer documents only top-1 and top-2; its
  general top-k gate takes a different load-balancing loss, so k > 2 is refused in the parent);
- ``drop_tokens=False`` (dropless): the capacity is the largest count of any expert on any rank of
  the ep group (an all-reduce MAX), every copy is kept; ``model.moe_capacity_factor`` is refused
  because DeepSpeed renormalises a token's gates over its *kept* copies and picks top-1's kept
  tokens by ``topk`` among ties, where the model keeps its gates and keeps tokens in order;
- ``use_rts=False``, ``noisy_gate_policy=None``, ``top2_2nd_expert_sampling=False``: no random
  token selection, no jitter, no Gumbel noise on the second choice: the routing is the model's;
- ``min_capacity=0``: no padding beyond the largest count.

DeepSpeed's gate takes its capacity and its aux loss ``l_aux`` over the tokens of one call. The
model's routing group is one sample (GShard's groups; models/moe.py), so the layer is called once
per sample: each sample routes, and its ``l_aux`` (Switch's E * sum_e f_e * P_e, the model's formula)
is taken, as in ``single``; the mean over the samples, times ``model.moe_aux_weight``, is recorded
in the model's ``AuxLosses``, which the training loss adds. One call per micro-batch would make the
aux loss depend on how the batch is split over the ranks.

Per call, each all-to-all moves DeepSpeed's padded E x C x h buffer (C the capacity above): two
forward (dispatch, combine) and two backward, plus the capacity's all-reduce (one int64).
``DeepSpeedExperts.traffic`` records these from the gate's own capacity (a forward hook).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_lab.models.moe import MoEMLP, moe_layers
from parallel_lab.strategies.ep.dispatch import Traffic
from parallel_lab.strategies.ep.parallel import in_single_order

CAPACITY_BYTES = 8  # the all-reduce MAX of the capacity: one int64


class DeepSpeedMoE(nn.Module):
    """An ``MoEMLP``'s place in the model, run by ``deepspeed.moe.layer.MoE`` (module docstring)."""

    def __init__(self, moe: MoEMLP, ep: int, share: int, traffic: Traffic) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        dim = moe.router.in_features
        self.layer = MoE(
            hidden_size=dim,
            expert=moe.experts[0],
            num_experts=moe.num_experts,
            ep_size=ep,
            k=moe.topk,
            min_capacity=0,
            drop_tokens=False,
            use_rts=False,
            noisy_gate_policy=None,
            top2_2nd_expert_sampling=False,
        )
        local = moe.num_experts // ep
        with torch.no_grad():
            self.layer.deepspeed_moe.gate.wg.weight.copy_(moe.router.weight)
            for i, expert in enumerate(self.local_experts()):
                expert.load_state_dict(moe.experts[share * local + i].state_dict())
        self.num_experts, self.ep, self.dim = moe.num_experts, ep, dim
        self.aux, self.aux_layer, self.aux_weight = moe.aux, moe.layer, moe.aux_weight
        self.traffic = traffic
        self.layer.deepspeed_moe.gate.register_forward_hook(self._count)

    def local_experts(self) -> nn.ModuleList:
        return self.layer.deepspeed_moe.experts.deepspeed_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, S, dim); one call of DeepSpeed's layer per sample (module docstring)."""
        outs, losses = [], []
        for sample in x:
            out, l_aux, _ = self.layer(sample)
            outs.append(out)
            losses.append(l_aux)
        self.aux.record(self.aux_layer, self.aux_weight * torch.stack(losses).mean())
        return torch.stack(outs)

    def _count(self, gate: nn.Module, inputs, output) -> None:
        """The gate returns its capacity second: each all-to-all's buffer is E x C x h."""
        if not torch.is_grad_enabled():  # evaluation: no backward, and not a training step
            return
        capacity = int(output[1])
        self.traffic.all_to_all += 4 * self.num_experts * capacity * self.dim * 4
        self.traffic.all_reduce += 2 * CAPACITY_BYTES


@dataclass
class DeepSpeedTraffic(Traffic):
    """``Traffic`` with the capacity's all-reduce in place of the counts' all-gather."""

    all_reduce: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"all_to_all_single": self.all_to_all, "all_reduce": self.all_reduce}


class DeepSpeedExperts:
    """A model's MoE MLPs swapped for DeepSpeed's layer, this rank holding share ``share`` of ``ep``.
    Built before ``deepspeed.initialize``, which creates the layers' ep groups."""

    def __init__(self, model: nn.Module, ep: int, share: int) -> None:
        self.ep, self.share = ep, share
        self.traffic = DeepSpeedTraffic()
        self.layers: list[DeepSpeedMoE] = []
        for moe in moe_layers(model):
            swapped = DeepSpeedMoE(moe, ep, share, self.traffic)
            _replace(model, moe, swapped)
            self.layers.append(swapped)

    def param_groups(self, model: nn.Module) -> list[dict]:
        """The optimizer's groups as DeepSpeed wants them under MoE: the dense parameters, then one
        group per expert-data-parallel group (``split_params_into_different_moe_groups_for_optimizer``)."""
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense-params"}
        )

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.local_experts().parameters()]

    @torch.no_grad()
    def full_parameters(self, model: nn.Module, whole=lambda p: p.detach().float()) -> list[torch.Tensor]:
        """Every parameter in ``single``'s order (router, then every expert), each layer's experts
        gathered from its ep group (collective)."""
        first = {id(next(layer.local_experts().parameters())): layer for layer in self.layers}
        return in_single_order(model, first, {id(p) for p in self.expert_parameters()}, self._gather, whole)

    def _gather(self, layer: DeepSpeedMoE) -> list[torch.Tensor]:
        local = [p.detach().float() for p in layer.local_experts().parameters()]
        flat = torch.cat([t.reshape(-1) for t in local])
        gathered = flat.new_empty(self.ep * flat.numel())
        dist.all_gather_into_tensor(gathered, flat, group=layer.layer.deepspeed_moe.ep_group)
        out = []
        for block in gathered.view(self.ep, -1):
            offset = 0
            for t in local:
                out.append(block[offset : offset + t.numel()].view_as(t).clone())
                offset += t.numel()
        return out

    def theory_bytes_per_step(self) -> dict[str, float]:
        steps = max(1, self.traffic.steps)
        return {op: n / steps for op, n in self.traffic.as_dict().items()}

    def metrics(self) -> dict:
        """metrics.json's ``strategy_extras.ep``, as under ddp/fsdp/tp, with the layer named."""
        return {
            "ep": {
                "degree": self.ep,
                "layer": "deepspeed.moe.layer.MoE",
                "theory_bytes_per_step": self.theory_bytes_per_step(),
            }
        }


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise ValueError("the MoE layer is not in the model")
