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
all-reduce by its two halves, the same bytes on the wire (plus one all-gather in backward, below):

- ``sequence_parallel_columns`` (the paper's *g*, with the column layers it feeds): all-gather
  along the tokens forward (entering the column-parallel region, which needs every token),
  reduce-scatter of the gradient backward; see below for what it saves (``gather_from_sequence``:
  the same collectives, the gathered tokens handed to layers that save them, as DTensor's do);
- ``reduce_scatter_to_sequence`` (the paper's *g-bar*): reduce-scatter of the row-parallel partial
  sums forward (each rank keeps the completed sum of its own tokens), all-gather backward;
- ``scatter_to_sequence``: take this rank's tokens of a replicated tensor (no communication),
  all-gather the gradient backward (the embedding's output entering the sharded region);

Megatron's column layers under SP (its ``LinearWithGradAccumulationAndAsyncCommunication``, sec.
4.2.2) keep only this rank's shard of their input for backward (2sbh/t, not the gathered 2sbh):
``sequence_parallel_columns`` gathers it again there, asynchronously, while it computes the input
gradient, waits before the weight gradients, and reduce-scatters the input gradient while it
computes them. That backward all-gather is bytes the all-reduce it replaces never sent.

On the meta device (the planner's forward) every function only shapes its output: no process
group is needed, and they save the same tensors either way, so the planner's count of saved
tensors is the real one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor.contiguous().clone()  # never reduce in place into a tensor autograd saved
    if not tensor.is_meta:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


class _Pending:
    """A collective in flight (``async_op=True``) and how to shape its buffer once it completes."""

    def __init__(self, work, out: torch.Tensor, finish) -> None:
        self.work, self.out, self.finish = work, out, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish(self.out)


def _start_all_gather(x: torch.Tensor, dim: int, group, size: int) -> _Pending:
    """``_all_gather`` started asynchronously: ``.wait()`` returns its result."""
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    work = None if x.is_meta else dist.all_gather_single(out, x.contiguous(), group=group, async_op=True)
    return _Pending(work, out, lambda o: o.unflatten(0, (size, -1)).movedim(0, dim).flatten(dim, dim + 1))


def gather_shards(local: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """A split parameter whole again: the ranks' shards concatenated along their split ``dim``
    (rank order), outside autograd (the final weights a run reports; not a step's traffic)."""
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _all_gather(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` (rank order)."""
    return _start_all_gather(x, dim, group, size).wait()


def _start_reduce_scatter(x: torch.Tensor, dim: int, group, size: int) -> _Pending:
    """``_reduce_scatter`` started asynchronously: ``.wait()`` returns its result."""
    parts = x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()  # chunk r first, as the collective cuts
    out = parts.new_empty(parts.shape[1:])
    work = None if x.is_meta else dist.reduce_scatter_single(out, parts.flatten(0, 1), group=group, async_op=True)
    return _Pending(work, out, lambda o: o)


def _reduce_scatter(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's chunk along ``dim``."""
    return _start_reduce_scatter(x, dim, group, size).wait()


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
    """SP's g without the column layers: all-gather along ``dim`` forward, reduce-scatter
    backward; the layers after it save the gathered tokens (as DTensor's ColwiseParallel does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.size), None, None, None


def gather_from_sequence(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Enter the column-parallel region from the sequence-parallel one, the tokens gathered for
    layers that keep them (the planner's model of the dtensor split)."""
    return _GatherFromSequence.apply(x, dim, group, size)


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


class _SequenceParallelColumns(torch.autograd.Function):
    """Column-parallel Linears entered from a sequence-parallel region, saving the input's shard.

    forward(x, dim, group, size, w0, b0, w1, b1, ...) -> (linear(gathered x, w_i, b_i) for each i):
    one all-gather of ``x`` along ``dim`` serves every layer; ``ctx`` keeps ``x`` (this rank's
    tokens) and the weights. Backward, as Megatron's: the all-gather of ``x`` is started, the input
    gradient (sum over the layers of grad_i @ w_i) computed while it runs, then waited for; the
    input gradient's reduce-scatter is started and the weight gradients computed (they need the
    gathered x) while it runs. Gloo runs async collectives on its own thread, NCCL on its stream:
    the overlap is real on both; meta shapes only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, size: int, *params: torch.Tensor | None):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        weights, biases = params[0::2], params[1::2]
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)  # the shard: 2sbh/t bytes, not the gathered 2sbh
        total = _all_gather(x, dim, group, size)
        return tuple(F.linear(total, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        gathering = _start_all_gather(x, ctx.dim, ctx.group, ctx.size)
        used = [(g, w) for g, w in zip(grads, weights) if g is not None]  # None: an output nobody used
        grad_total = sum(torch.matmul(g, w) for g, w in used)  # overlaps the gather
        total = gathering.wait().flatten(0, -2)
        scattering = _start_reduce_scatter(grad_total, ctx.dim, ctx.group, ctx.size)
        params: list[torch.Tensor | None] = []
        for g, has_bias in zip(grads, ctx.has_bias):  # overlap the input gradient's reduce-scatter
            rows = None if g is None else g.flatten(0, -2)
            params += [
                None if rows is None else rows.t().matmul(total),
                rows.sum(0) if has_bias and rows is not None else None,
            ]
        return (scattering.wait(), None, None, None, *params)


def sequence_parallel_columns(
    x: torch.Tensor, dim: int, group, size: int, layers: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> tuple[torch.Tensor, ...]:
    """Every (weight, bias) Linear of ``layers`` applied to the tokens of all ranks, ``x`` holding
    this rank's: the output of each, the input kept sharded for backward (``_SequenceParallelColumns``)."""
    return _SequenceParallelColumns.apply(x, dim, group, size, *(t for pair in layers for t in pair))


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
