"""The two conjugate collectives of Megatron-style tensor parallelism (arXiv 1909.08053, sec. 3).

A column-parallel layer followed by a row-parallel layer needs exactly one all-reduce in the
forward pass and one in the backward pass. They are the two autograd functions below; each is the
other's transpose, which is why the paper calls them conjugate:

- ``copy_to_tp`` (the paper's *f*): identity forward, all-reduce backward. It sits where a
  replicated activation enters the split region. Every rank uses the whole input in forward, but
  each rank's shard only produces part of the input's gradient, so the parts are summed.
- ``reduce_from_tp`` (the paper's *g*): all-reduce forward, identity backward. It sits where the
  split region ends. Each rank holds a partial sum of the output; the all-reduce completes it.
  The gradient of a sum with respect to each addend is the upstream gradient itself.

Both take the process group of the tensor-parallel ranks, so a later dp x tp layout can pass the
tp sub-group instead of the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor.contiguous().clone()  # never reduce in place into a tensor autograd saved
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class _CopyToTensorParallel(torch.autograd.Function):
    """f: forward identity, backward all-reduce (sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward all-reduce (sum), backward identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter the tensor-parallel region (Megatron's f)."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave the tensor-parallel region (Megatron's g)."""
    return _ReduceFromTensorParallel.apply(x, group)
