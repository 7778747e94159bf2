"""A mixture-of-experts MLP (``model.moe_experts``, ``model.moe_topk``, ``model.moe_every``): a
router picks each token's top-k of E expert MLPs and the token's output is their gate-weighted sum
(Shazeer et al. 2017; GShard, Lepikhin et al., arXiv 2006.16668; Switch, Fedus et al., arXiv
2101.03961; V-MoE, Riquelme et al., arXiv 2106.05974, on a vision transformer's every n-th block).

What it computes, each choice with its source:
- the router is a bias-free Linear dim -> E, softmax over the experts (GShard's ``wg``); top-k of
  the probabilities; with k > 1 the k gates are renormalised to sum to 1 (GShard's top-2), with
  k = 1 the gate is the probability itself (Switch);
- routing groups are the samples (GShard's "groups", section 3.2 of 2006.16668): each sample's tokens
  are one group, over which the load-balancing loss and the capacity are taken. A sample's routing
  therefore depends on that sample alone, so every data-parallel split of the batch routes, drops
  and balances exactly as one process does (as models/dropout.py keys its masks by sample);
- the load-balancing loss per group is Switch's E * sum_e f_e * P_e (f_e: share of the group's
  tokens whose first choice is e, P_e: mean router probability of e), averaged over the groups and
  weighted by ``model.moe_aux_weight``; the model records it (``AuxLosses``) and the training loss
  adds it (models/__init__.py ``training_loss``);
- capacity (``model.moe_capacity_factor``, null = dropless): each expert takes at most
  C = ceil(cf * k * S / E) of a group's S tokens' copies, first choices before second ones, then in
  token order (GShard's priority); a dropped copy contributes nothing (the residual carries the token).

The experts run through ``dispatch(tokens, counts, experts)``: the copies sorted by expert, ``counts``
per expert, returning the experts' outputs in the same order. One process runs them in place
(``run_experts``); expert parallelism (strategies/ep/) replaces ``dispatch`` with an all-to-all to
the ranks holding the experts and ``experts`` with this rank's share. The module itself knows
nothing of processes.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.models.specs import MOE_DEFAULTS  # noqa: F401  (re-exported: its one home is specs.py)

Dispatch = Callable[[torch.Tensor, torch.Tensor, nn.ModuleList], torch.Tensor]


class AuxLosses:
    """The weighted load-balancing losses of a model's MoE layers from their latest forward, by
    layer (a layer's newer forward replaces its older one). A plain attribute: no state_dict key."""

    def __init__(self) -> None:
        self.by_layer: dict[int, torch.Tensor] = {}

    def record(self, layer: int, value: torch.Tensor) -> None:
        self.by_layer[layer] = value

    def clear(self) -> None:
        """Forget every layer's: a pipeline stage's next forward then records only its own layers."""
        self.by_layer.clear()

    def total(self) -> torch.Tensor | None:
        return sum(self.by_layer.values()) if self.by_layer else None


class Expert(nn.Module):
    """One expert: the dense MLP's shape, fc1 -> GELU -> fc2 (no dropout: a token's copies are
    reordered, so a sample-keyed mask would not follow them)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def run_experts(tokens: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """One process holding every expert: ``tokens`` sorted by expert, ``counts[e]`` rows each."""
    chunks = tokens.split(counts.tolist())
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])


class Routing:
    """Where one forward's token copies go: ``token``, ``expert`` and ``gate`` per kept copy, sorted
    by expert; ``counts`` per expert; ``aux`` the unweighted load-balancing loss."""

    def __init__(self, token: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor, aux: torch.Tensor, num: int):
        order = torch.argsort(expert, stable=True)
        self.token, self.expert, self.gate = token[order], expert[order], gate[order]
        self.counts = torch.bincount(self.expert, minlength=num)
        self.aux = aux

    @classmethod
    def balanced(cls, token: torch.Tensor, gate: torch.Tensor, aux: torch.Tensor, num: int) -> "Routing":
        """A meta-device forward's routing: no values to route by, so the copies are spread
        evenly, counts on the CPU (a meta tensor has no values to split by)."""
        r = cls.__new__(cls)
        order = torch.arange(len(token), device=token.device)  # the real sort's gather (it saves its index)
        r.token, r.gate, r.aux = token[order], gate[order], aux
        share, extra = divmod(len(token), num)
        r.counts = torch.tensor([share + (e < extra) for e in range(num)])
        r.expert = None
        return r


def capacity(capacity_factor: float, topk: int, tokens: int, experts: int) -> int:
    """Copies an expert takes from one group of ``tokens`` (GShard's 2N/E at k=2, cf=1)."""
    return math.ceil(capacity_factor * topk * tokens / experts)


def kept_copies(top_e: torch.Tensor, experts: int, cap: int) -> torch.Tensor:
    """(B, S, k) bool: which copies fit their expert's capacity, first choices of all the group's
    tokens before any second choice, then in token order."""
    b, s, k = top_e.shape
    onehot = F.one_hot(top_e.transpose(1, 2).reshape(b, k * s), experts)  # choice-major priority
    position = ((onehot.cumsum(1) - 1) * onehot).sum(-1)
    return (position < cap).reshape(b, k, s).transpose(1, 2)


class MoEMLP(nn.Module):
    """The MLP of a transformer block as E experts and a top-k router (module docstring)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        topk: int,
        capacity_factor: float | None,
        aux_weight: float,
        layer: int,
        aux: AuxLosses,
    ) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.num_experts, self.topk, self.capacity_factor = experts, topk, capacity_factor
        self.aux_weight, self.layer, self.aux = aux_weight, layer, aux
        self.dispatch: Dispatch = run_experts  # expert parallelism sets its all-to-all here

    def route(self, x: torch.Tensor) -> Routing:
        """x: (B, S, dim), each sample a routing group."""
        b, s, _ = x.shape
        probs = self.router(x).softmax(dim=-1)
        top_p, top_e = probs.topk(self.topk, dim=-1)
        gates = top_p / top_p.sum(-1, keepdim=True) if self.topk > 1 else top_p
        first = F.one_hot(top_e[..., 0], self.num_experts).to(probs.dtype)
        aux = self.num_experts * (first.mean(1) * probs.mean(1)).sum(-1).mean()
        token = torch.arange(b * s, device=x.device).repeat_interleave(self.topk)
        expert, gate = top_e.reshape(-1), gates.reshape(-1)
        if x.is_meta:  # shapes only (FLOPs, saved bytes, models/flops.py, plan/): every expert an equal share
            return Routing.balanced(token, gate, aux, self.num_experts)
        if self.capacity_factor is not None:
            keep = kept_copies(top_e, self.num_experts, capacity(self.capacity_factor, self.topk, s, self.num_experts))
            keep = keep.reshape(-1)
            token, expert, gate = token[keep], expert[keep], gate[keep]
        return Routing(token, expert, gate, aux, self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.route(x)
        self.aux.record(self.layer, self.aux_weight * r.aux)
        flat = x.reshape(-1, x.shape[-1])
        out = self.dispatch(flat[r.token], r.counts, self.experts)
        combined = torch.zeros_like(flat).index_add(0, r.token, out * r.gate.unsqueeze(1).to(out.dtype))
        return combined.view_as(x)


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]
