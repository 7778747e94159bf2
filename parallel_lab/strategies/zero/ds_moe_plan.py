"""The planner's copy of DeepSpeed's MoE layer under ``zero0``..``zero2`` with ``strategy.ep``
(ds_moe.py): a meta model whose MoE MLPs are swapped for ``deepspeed.moe.layer.MoE`` exactly as a
run swaps them, so that the planner's meta forward counts what DeepSpeed's gate, dispatch, experts
and combine save for backward (DeepSpeed-MoE, arXiv 2201.05596; GShard's gate, arXiv 2006.16668),
not what the model's own layer saves.

DeepSpeed's code runs unchanged on the meta device except where it needs values or other ranks,
in DeepSpeed 0.19.8's ``deepspeed/moe/sharded_moe.py``:

- the dropless capacity: ``top1gating``/``top2gating`` take the largest expert count, all-reduce it
  (MAX) over the ep group and, at top-1, clamp it by the tokens with the builtin ``min``;
  ``MOELayer.forward`` then reads it with ``int(C)``. The planner takes every expert equally loaded
  (as for the model's own layer, models/moe.py ``Routing.balanced``): C = ceil(k * S / E) for a
  call's S tokens, given as a CPU integer tensor (top-2: the gate's returned capacity replaced;
  top-1: ``min``, the only place its capacity is formed, answers it). The all-reduce itself is
  skipped by DeepSpeed at ``ep_group=None`` (``pg_utils.is_parallel``), the planner's layer having
  no group;
- the two all-to-alls (``_AllToAll``): shapes only (``PlannedAllToAll``), saving nothing, as
  ``_AllToAll`` saves nothing (its ctx keeps only the group).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch
import torch.nn as nn

from parallel_lab.models.moe import moe_layers
from parallel_lab.strategies.zero.ds_moe import DeepSpeedMoE, DeepSpeedTraffic, _replace


class PlannedAllToAll(torch.autograd.Function):
    """``sharded_moe._AllToAll`` without the exchange: an output of the input's shape, nothing saved."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, torch.empty_like(grad)


def balanced_capacity(tokens: int, experts: int, topk: int) -> int:
    """The dropless capacity with every expert equally loaded: ceil(k * S / E) copies each."""
    return math.ceil(topk * tokens / experts)


@contextlib.contextmanager
def _meta_capacity(capacity: int) -> Iterator[None]:
    """sharded_moe's gate and layer with the capacity ``capacity`` and shape-only all-to-alls
    (module docstring); restored on exit."""
    from deepspeed.moe import sharded_moe

    real_top2, real_a2a = sharded_moe.top2gating, sharded_moe._AllToAll

    def top2(*args, **kwargs):
        out = real_top2(*args, **kwargs)
        return (out[0], torch.tensor(capacity), *out[2:])

    sharded_moe.top2gating, sharded_moe._AllToAll = top2, PlannedAllToAll
    sharded_moe.min = lambda *args: torch.tensor(capacity)  # top-1's clamp: shadows the builtin there only
    try:
        yield
    finally:
        sharded_moe.top2gating, sharded_moe._AllToAll = real_top2, real_a2a
        del sharded_moe.min


class PlannedDeepSpeedMoE(DeepSpeedMoE):
    """DeepSpeedMoE on the meta device: each call (one sample, ds_moe.py) under ``_meta_capacity``
    with the balanced capacity of its S tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.layer.deepspeed_moe.gate
        with _meta_capacity(balanced_capacity(x.shape[1], self.num_experts, gate.k)):
            return super().forward(x)


def deepspeed_moe_meta(model: nn.Module, ep: int, share: int) -> nn.Module:
    """A meta copy of ``model`` with every MoE MLP run by DeepSpeed's layer as rank ``share`` of its
    ep group holds it (E / ep experts); the model itself without MoE layers."""
    if not moe_layers(model):
        return model
    copied = copy.deepcopy(model)
    with torch.device("meta"):
        for moe in moe_layers(copied):
            _replace(copied, moe, PlannedDeepSpeedMoE(moe, ep, share, DeepSpeedTraffic()))
    return copied
