"""Megatron's split of the gpt (Shoeybi et al., arXiv 1909.08053, sec. 3): the blocks as the
vit's (``megatron.py``), the vocabulary split over the tp ranks at both ends.

t = the tp degree, V = model.vocab; rank r owns the token ids [r V/t, (r+1) V/t):

- ``VocabParallelEmbedding`` (``embed.tokens``): rank r holds those V/t rows. It looks up the ids in
  its range (the others read row 0, then zeroed) and the ranks' partial embeddings are summed by
  one all-reduce (g: identity backward, each rank's rows get their own ids' gradient). Positions
  and the embedding dropout then run on the whole (replicated) activation.
- the head's output projection is column-parallel over the vocabulary: the final LayerNorm's output
  enters the split region by f (all-reduce of its gradient backward) and rank r computes its V/t
  logits. Tied embeddings: the head's weight is the embedding's, so it is the same shard of rows,
  with no further communication (the two gradients of the one shard add on the rank).
- ``vocab_parallel_cross_entropy``: the loss from the (batch, V/t, seq) logit shards without
  gathering them: all-reduce the per-token max, the sum of exp(logit - max) and the target's
  logit (owned by one rank, 0 on the others); loss = log(sum) - (target - max). Backward needs no
  communication: softmax (this rank's columns) minus the one-hot of a target it owns.

Sequence parallelism (arXiv 2205.05198): the blocks' token regions as the vit's; the embedding's
(replicated) output is scattered to each rank's tokens (its gradient all-gathered back), and the
head's LayerNorm runs on this rank's tokens, whose output is all-gathered (reduce-scattered
backward) for the vocabulary projection, as Megatron's output layer gathers its input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel_lab.strategies.tp.comm import (
    _all_gather,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    scatter_to_sequence,
)
from parallel_lab.strategies.tp.layers import ColumnParallel, replace_module
from parallel_lab.strategies.tp.megatron import TOKENS, TPGroup, split_blocks

CLASSES = 1  # the vocabulary dimension of the gpt's (batch, vocab, seq) logits


def vocab_layers(model: nn.Module) -> list[str]:
    """The layers split over the vocabulary (by rows, dim 0): the embedding and, untied, the head's."""
    return ["embed.tokens"] + (["head.out"] if getattr(model.head, "out", None) is not None else [])


class VocabParallelEmbedding(nn.Module):
    """An nn.Embedding's rows [rank V/t, (rank+1) V/t) (``weight``, the dense layer's name): ids
    outside them look up nothing here, and g sums the ranks' lookups."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(embedding.weight.detach().chunk(tp.size, 0)[tp.rank].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.tp.rank * self.weight.shape[0]
        outside = (ids < start) | (ids >= start + self.weight.shape[0])
        local = F.embedding((ids - start).masked_fill(outside, 0), self.weight)
        return reduce_from_tp(local.masked_fill(outside.unsqueeze(-1), 0.0), self.tp.group)


def _all_reduce_(t: torch.Tensor, op, group) -> torch.Tensor:
    if not t.is_meta:  # the planner's forward only shapes
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean next-token cross-entropy of (batch, V/t, seq) logit shards over (batch, seq) targets."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        width = logits.shape[CLASSES]
        start = tp.rank * width
        top = _all_reduce_(logits.detach().amax(CLASSES), dist.ReduceOp.MAX, tp.group)  # max all-reduce
        shifted = logits - top.unsqueeze(CLASSES)  # no rank's exp overflows: every shift is by the global max
        exp = shifted.exp()
        total = _all_reduce_(exp.sum(CLASSES), dist.ReduceOp.SUM, tp.group)
        mine = (targets >= start) & (targets < start + width)  # the targets this rank's columns hold
        local = (targets - start).masked_fill(~mine, 0)
        picked = shifted.gather(CLASSES, local.unsqueeze(CLASSES)).squeeze(CLASSES).masked_fill(~mine, 0.0)
        target = _all_reduce_(picked, dist.ReduceOp.SUM, tp.group)  # the target's logit, from its one owner
        ctx.save_for_backward(exp.div_(total.unsqueeze(CLASSES)), local, mine)  # softmax of this rank's columns
        return (total.log() - target).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        out = softmax.clone()  # d loss / d logit = (softmax - onehot(target)) / tokens
        out.scatter_add_(CLASSES, local.unsqueeze(CLASSES), -mine.unsqueeze(CLASSES).to(out.dtype))
        return out.mul_(grad / local.numel()), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``F.cross_entropy(full logits, targets)`` (mean) from this rank's vocabulary columns of the
    logits; computed in fp32 (a bf16 forward's logits are cast first, as Megatron does)."""
    return _VocabParallelCrossEntropy.apply(logits.float(), targets, tp)


class VocabParallelLoss:
    """The tp strategy's ``loss_fn`` for the gpt (called as torch's ``CrossEntropyLoss``)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.tp)


def gather_vocab(logits: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The whole (batch, V, seq) logits from every rank's columns (evaluation's argmax; no autograd)."""
    return _all_gather(logits, CLASSES, tp.group, tp.size)


def split_gpt(model: nn.Module, tp: TPGroup, sequence_parallel: bool) -> dict[str, int]:
    """The gpt split in place over ``tp`` (module docstring); {sharded parameter: its split dim}."""
    shard_dims = split_blocks(model, tp, sequence_parallel)
    head = model.head
    tied = getattr(head, "out", None) is None
    replace_module(model, "embed.tokens", VocabParallelEmbedding(model.embed.tokens, tp))
    shard_dims["embed.tokens.weight"] = 0
    if not tied:  # a holder of the rows (Head.forward reads ``out.weight``); tied: the embedding's shard
        replace_module(model, "head.out", ColumnParallel(head.out, tp.group, tp.rank, tp.size, True))
        shard_dims["head.out.weight"] = 0
    if sequence_parallel:
        model.embed.register_forward_hook(
            lambda _m, _a, out: scatter_to_sequence(out, TOKENS, tp.group, tp.rank, tp.size)
        )
        head.norm.register_forward_hook(lambda _m, _a, out: gather_from_sequence(out, TOKENS, tp.group, tp.size))
    else:
        head.norm.register_forward_hook(lambda _m, _a, out: copy_to_tp(out, tp.group))
    return shard_dims


class WithVocabLoss(nn.Module):
    """A split gpt and its vocab-parallel loss as one module, for the planner's meta forward (it
    counts what the loss saves too: the softmax of this rank's columns, the targets' local index
    and owner mask)."""

    takes_tokens = True  # models.sample_input: token ids

    def __init__(self, model: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.model, self.tp = model, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        targets = torch.zeros(logits.shape[0], logits.shape[2], dtype=torch.long, device=logits.device)
        return vocab_parallel_cross_entropy(logits, targets, self.tp)
