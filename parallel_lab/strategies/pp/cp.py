"""pp x cp: context parallelism inside each pipeline stage (``strategy=pp strategy.cp=C``; the
layout: ``cp_rules.py``). Each stage's cp ranks hold the same blocks and the same samples, each its
T/cp tokens of them (Liu et al., ring attention, arXiv 2310.01889; Jacobs et al., DeepSpeed-Ulysses,
arXiv 2309.14509; the pipeline: ``strategy.py``):

- stage 0 slices the embedding's output to the rank's tokens (the vit) or feeds the embedding the
  rank's token ids with their own positions (the gpt: the load-balanced zig-zag pieces under the
  ring), as ``cp/parallelize.py`` does to the whole model;
- every stage's blocks run cp's attention core (``ContextParallelCore``) over the stage's cp group,
  whose sends travel beside the pipeline's (another process group: their tags never meet);
- the last stage runs the vit's pooled head (the tokens' sum all-reduced over the stage's cp
  group) or takes the gpt's cross-entropy over the rank's own labels;
- the hand-offs between stages carry (micro-batch, T/cp, hidden);
- gradients are averaged over the cp group and then over the replicas (replicate x cp), the
  data-parallel average of the whole gradient (``cp/strategy.py`` says why an average is right).

Here: the stage's change (``parallelize_stage``, which the planner's meta copy runs too) and the
strategy's run-time helpers."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from parallel_lab.strategies.cp.comm import TOKENS, CPGroup
from parallel_lab.strategies.cp.parallelize import (
    ContextParallelCore,
    ContextParallelHead,
    blocks,
    gather_tokens,
    take_tokens,
    token_pieces,
)
from parallel_lab.strategies.mesh import average_gradients


def parallelize_stage(
    stage: nn.Module, cfg: DictConfig, cp: CPGroup, first: bool, last: bool
) -> list[tuple[int, int]] | None:
    """Shard a stage's (or one chunk's) tokens over its cp group, in place: the embedding if
    ``first``, every block's attention core, the vit's head if ``last``. Returns the gpt's pieces of
    the sequence this rank holds (the labels it takes), None on the vit. Parameter names unchanged."""
    impl = str(cfg.strategy.cp_impl)  # ring | ulysses (cp_rules.py refuses deepspeed's layer here)
    gpt = cfg.model.name == "gpt"
    pieces = None
    if gpt:
        from parallel_lab.models.gpt_sizes import gpt_sizes

        pieces = token_pieces(gpt_sizes(cfg.model)["seq"], cp.size, cp.rank, impl)
        positions = torch.cat([torch.arange(start, start + length) for start, length in pieces])
    if first and gpt:
        stage.embed.register_forward_pre_hook(lambda _m, args: (take_tokens(args[0], pieces, 1),))
        stage.embed.pieces = pieces
    elif first:  # contiguous: the first block saves its own slice, not a view of every token
        stage.embed.register_forward_hook(lambda _m, _a, out: out.chunk(cp.size, TOKENS)[cp.rank].contiguous())
    for block in blocks(stage):
        if gpt:
            block.attn.positions = positions
        block.attn.core = ContextParallelCore(block.attn.core, cp, impl, causal=gpt)
    if last and not gpt:
        stage.head = ContextParallelHead(stage.head, cp)
    return pieces


def context_stage(pipe, model: nn.Module) -> None:
    """The strategy's stage under strategy.cp > 1, before its chunks are made: the cp group of the
    stage (its ranks of one (replicate, pp) coordinate), the stage sharded, and the gpt's loss taken
    over the rank's labels."""
    if pipe.layout.cp < 2:
        return
    ranks = tuple(pipe.layout.group_ranks(pipe.env.rank, "cp"))
    pipe.cp_group = CPGroup(pipe.mesh.group("cp"), ranks.index(pipe.env.rank), pipe.layout.cp, ranks)
    pipe.cp_pieces = parallelize_stage(model, pipe.cfg, pipe.cp_group, pipe.is_first, pipe.is_last)
    if pipe.cp_pieces is not None and pipe.is_last:
        whole, pieces = pipe.loss_fn, pipe.cp_pieces
        pipe.loss_fn = lambda logits, labels: whole(logits, take_tokens(labels, pieces))


def average_over_cp(pipe) -> None:
    """The stage's gradients averaged over its cp group (each cp rank's is its tokens' share)."""
    if pipe.layout.cp > 1:
        average_gradients(pipe.model.parameters(), pipe.cp_group.group, pipe.layout.cp)


def gathered_logits(pipe, logits: torch.Tensor | None) -> torch.Tensor | None:
    """Evaluation: the gpt's last stage gathers every token's logits (batch, vocab, T) from its cp
    group, each rank's pieces put in their places (every cp rank then scores the whole sequence,
    as the vit's pool gives each the same logits)."""
    if logits is None or pipe.layout.cp < 2 or pipe.cp_pieces is None:
        return logits
    return gather_tokens(logits, pipe.cp_group, str(pipe.opts.cp_impl))
