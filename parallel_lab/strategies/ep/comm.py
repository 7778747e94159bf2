"""The all-to-all of expert parallelism, as an autograd function (GShard, Lepikhin et al., arXiv
2006.16668, section 2.2; Switch, Fedus et al., arXiv 2101.03961, section 2.2): forward sends
``input_splits[r]`` rows to rank r of the group and receives ``output_splits[r]`` rows from it;
backward is the same exchange with the splits swapped, carrying each row's gradient back to the
rank whose row it was. Uneven splits: how many copies go where is the router's choice each step.

``torch.distributed.all_to_all_single`` on CPU tensors is gloo's alltoallv (uneven splits included;
docs/facts.md). Written here, not taken from ``torch.distributed.nn``, so that the exchange is one
visible function with its backward beside it (picotron's layout), counted by comm/counter.py as
every other collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the group's ranks by ``input_splits``; the rows received, by ``output_splits``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        return exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back_out, back_in = ctx.splits  # the gradient of a row goes back where the row came from
        return exchange(grad, back_out, back_in, ctx.group), None, None, None


def exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` (``AllToAll``)."""
    return AllToAll.apply(x, output_splits, input_splits, group)


class PlannedExchange(torch.autograd.Function):
    """AllToAll's shapes without its communication (the planner's meta forward): ``rows`` rows out,
    nothing saved, as AllToAll saves nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.rows_in = x.shape[0]
        return x.new_empty((rows, *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.new_empty((ctx.rows_in, *grad.shape[1:])), None
