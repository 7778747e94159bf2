"""The manual split: a dense layer replaced by a module holding one shard of it.

Column-parallel keeps a slice of the output features (Linear) or output channels (Conv2d);
row-parallel keeps the matching slice of the inputs and completes its partial sum with one
all-reduce (``comm.reduce_from_tp``). Parameter names stay the dense layer's (``weight``, ``bias``),
so checkpoints and the parity check line up with the single model.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from parallel_lab.strategies.tp.comm import copy_to_tp, reduce_from_tp, reduce_scatter_to_sequence


def _functional(layer: nn.Module):
    """The layer's computation as a function of (input, weight, bias), so a shard can be passed."""
    if isinstance(layer, nn.Linear):
        return F.linear
    if isinstance(layer, nn.Conv2d) and layer.groups == 1 and layer.padding_mode == "zeros":
        return partial(F.conv2d, stride=layer.stride, padding=layer.padding, dilation=layer.dilation)
    raise TypeError(f"tensor parallelism here splits nn.Linear and plain nn.Conv2d, not {type(layer).__name__}")


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> nn.Parameter:
    return nn.Parameter(t.detach().chunk(size, dim)[rank].clone())


class ColumnParallel(nn.Module):
    """Output features (Linear) or output channels (Conv2d) split across the tp ranks.
    Parameters keep the dense layer's names (``weight``, ``bias``) so checkpoints line up."""

    def __init__(self, layer: nn.Module, group, rank: int, size: int, entered: bool = False) -> None:
        """entered: the input already passed the region's entry (f or SP's all-gather) once for
        several column layers (the vit's q, k, v share one), so this layer communicates nothing."""
        super().__init__()
        self.fn = _functional(layer)
        self.group, self.entered = group, entered
        self.weight = _shard(layer.weight, 0, rank, size)
        self.bias = _shard(layer.bias, 0, rank, size) if layer.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # f: the whole input is used here; in backward the ranks' partial input-gradients are summed.
        return self.fn(x if self.entered else copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallel(nn.Module):
    """Input features/channels split across the tp ranks; output = all-reduce of partial sums."""

    def __init__(
        self, layer: nn.Module, group, rank: int, size: int, input_is_split: bool, sequence_parallel: bool = False
    ) -> None:
        """sequence_parallel: leave into a region sharded along the tokens (dim 1): reduce-scatter
        the partial sums instead of all-reducing them; the bias is then added to this rank's tokens."""
        super().__init__()
        self.fn = _functional(layer)
        self.group, self.rank, self.size = group, rank, size
        self.input_is_split, self.sequence_parallel = input_is_split, sequence_parallel
        self.in_features = getattr(layer, "in_features", None)  # the dense width (the vit reads head_dim from it)
        self.weight = _shard(layer.weight, 1, rank, size)
        # The bias is added once, after the sum, so it stays whole (replicated) on every rank.
        self.bias = nn.Parameter(layer.bias.detach().clone()) if layer.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_split:
            # Replicated input (no column layer before us): take our slice of the features. f sums
            # the zero-padded slice gradients in backward, giving the whole input gradient.
            x = copy_to_tp(x, self.group).chunk(self.size, dim=1)[self.rank]
        partial = self.fn(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, 1, self.group, self.size)  # g-bar
        else:
            y = reduce_from_tp(partial, self.group)  # g
        if self.bias is not None:
            # Linear: features are the last dim (any leading dims); Conv2d: channels are dim 1.
            y = y + (self.bias if self.in_features is not None else self.bias.reshape(1, -1, 1, 1))
        return y


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
