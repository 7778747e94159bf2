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

Sequence parallelism (Korthikanti et al., arXiv 2205.05198, sec. 4.2.2) shards the regions between
the split layers (LayerNorm, residual, dropout) along the tokens dimension and replaces each
all-reduce by its two halves, the same bytes on the wire:

- ``gather_from_sequence`` (the paper's *g*): all-gather along the tokens forward (entering the
  column-parallel region, which needs every token), reduce-scatter of the gradient backward;
- ``reduce_scatter_to_sequence`` (the paper's *g-bar*): reduce-scatter of the row-parallel partial
  sums forward (each rank keeps the completed sum of its own tokens), all-gather backward;
- ``scatter_to_sequence``: take this rank's tokens of a replicated tensor (no communication),
  all-gather the gradient backward (the embedding's output entering the sharded region).

On the meta device (the planner's forward) every function only shapes its output: no process
group is needed, and autograd saves nothing in them either way, so the planner's count of saved
tensors is the real one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor.contiguous().clone()  # never reduce in place into a tensor autograd saved
    if not tensor.is_meta:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _all_gather(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` (rank order)."""
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the collective concatenates along dim 0
    if not x.is_meta:
        dist.all_gather_single(out, x.contiguous(), group=group)
    # one copy: (size, .., local, ..) -> (.., size * local, ..)
    return out.unflatten(0, (size, -1)).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's chunk along ``dim``."""
    parts = x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()  # chunk r first, as the collective cuts
    out = parts.new_empty(parts.shape[1:])
    if not x.is_meta:
        dist.reduce_scatter_single(out, parts.flatten(0, 1), group=group)
    return out


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


class _GatherFromSequence(torch.autograd.Function):
    """SP's g: all-gather along ``dim`` forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.size), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP's g-bar: reduce-scatter along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _reduce_scatter(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.size), None, None, None


class _ScatterToSequence(torch.autograd.Function):
    """This rank's chunk along ``dim`` forward (no communication), all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, rank: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return x.chunk(size, dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.size), None, None, None, None


def gather_from_sequence(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Enter the column-parallel region from the sequence-parallel one (all-gather the tokens)."""
    return _GatherFromSequence.apply(x, dim, group, size)


def reduce_scatter_to_sequence(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Leave the row-parallel region into the sequence-parallel one (reduce-scatter the partial sums)."""
    return _ReduceScatterToSequence.apply(x, dim, group, size)


def scatter_to_sequence(x: torch.Tensor, dim: int, group, rank: int, size: int) -> torch.Tensor:
    """A replicated tensor's tokens of this rank; the ranks' gradients gathered back in backward."""
    return _ScatterToSequence.apply(x, dim, group, rank, size)


class _GatherToReplicated(torch.autograd.Function):
    """All-gather along ``dim`` forward for a replicated consumer; backward keeps this rank's chunk
    of the (identical on every rank) gradient: no communication."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, rank: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, rank, size
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size, ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def gather_to_replicated(x: torch.Tensor, dim: int, group, rank: int, size: int) -> torch.Tensor:
    """The sequence-sharded tokens, whole on every rank, for a replicated module (DTensor's head)."""
    return _GatherToReplicated.apply(x, dim, group, rank, size)
