"""Tied embeddings across a pipeline (``model=gpt model.tied=true strategy=pp``), as Megatron-LM
builds them (Shoeybi et al., arXiv 1909.08053; Narayanan et al., arXiv 2104.04473): the word
embedding is used by the first stage (the lookup) and by the last (the output projection). The
last stage holds its own copy of the weight, cut from the same seeded model as the first stage's
(so both start as single's tied weight); after backward the two copies' gradients are summed by an
all-reduce over the *embedding group*, the first and the last stage of each pipeline, so each copy
holds single's gradient of the one weight, takes the same optimizer step and stays bit-equal.

The copy is an ``EmbeddingCopy`` registered on the last stage under the single model's name
``embed`` (parameter ``embed.tokens.weight``, first in the stage's order as in single's): a
checkpoint's shards keep single's names, the rank-shards reader takes the first of equal copies,
and a resharded load hands the last stage single's weight. It sits at the front of the last chunk
and passes its input through, so the chunk's parameters (bf16's per-forward copies, the planner's
meta forward) include the weight the head projects with. The planner (``chunks.rank_module``)
counts it in the last stage's state and the all-reduce in both ends' communication (``rules.py``)."""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

EMBED = "embed"  # the first stage's block that owns the word embedding (models/gpt.py)


class EmbeddingCopy(nn.Module):
    """The last stage's copy of the word embedding: holds ``tokens`` (an ``nn.Embedding``) and
    passes its input through (it only has to be in the last chunk's parameters)."""

    def __init__(self, tokens: nn.Embedding) -> None:
        super().__init__()
        self.tokens = tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def planned_copy(model: nn.Module) -> EmbeddingCopy:
    """The planner's view of the copy on the meta model: its own ``tokens`` module, shared (the
    head's tied weight is that module's, so the meta forward reads the copy's weight)."""
    return _holder(model.get_submodule(EMBED).tokens)


@functools.lru_cache(maxsize=32)
def _holder(tokens: nn.Embedding) -> EmbeddingCopy:
    """One holder per meta embedding, so the planner's caches keyed by modules still hit (a meta
    module holds no memory)."""
    return EmbeddingCopy(tokens)


def make_copy(children: dict[str, nn.Module]) -> EmbeddingCopy:
    """The last stage's copy, from the whole seeded model this rank built (before its other stages'
    weights are freed): a clone of the embedding's ``tokens``, and the head now projects with it."""
    holder = EmbeddingCopy(copy.deepcopy(children[EMBED].tokens))
    children["head"].tie(holder)
    return holder


def embedding_group(pipe):
    """This rank's embedding group (the first and last stage of its pipeline), None when it is in
    none. Collective (a tied pipeline's ranks only call it): every rank of the world creates every
    pipeline's group, in the same order."""
    layout = pipe.layout
    pipelines = dict.fromkeys(tuple(layout.group_ranks(r, "pp")) for r in range(pipe.env.world_size))
    mine = None
    for ranks in pipelines:
        group = dist.new_group([ranks[0], ranks[-1]])
        if pipe.env.rank in (ranks[0], ranks[-1]):
            mine = group
            pipe.comm.label_group(group, "embedding")
    return mine


def tied_weight(pipe) -> nn.Parameter:
    """This end's copy of the word embedding (the first stage's own, or the last stage's copy)."""
    return pipe.model.get_submodule(EMBED).tokens.weight


def sum_tied_gradients(pipe) -> None:
    """The embedding group's all-reduce (sum) of the word embedding's gradient: the lookup's part
    (first stage) plus the projection's (last), single's gradient of the tied weight on both."""
    if pipe.embedding_group is None:
        return
    dist.all_reduce(tied_weight(pipe).grad, op=dist.ReduceOp.SUM, group=pipe.embedding_group)


def counted_once(pipe, name: str) -> bool:
    """Whether the gradient norm counts parameter ``name`` of this stage: the last stage's copy of
    the embedding is the first stage's weight, counted there."""
    return not (pipe.embedding_group is not None and pipe.is_last and name == f"{EMBED}.tokens.weight")
