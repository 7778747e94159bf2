"""What ``tp`` holds, saves and sends for the gpt (the split: ``vocab.py``), from its shapes alone.

Memory: the blocks' column/row shards as the vit's, and V/t rows of the embedding (and of the untied
output projection); everything else whole. Activations: a meta copy split as the run splits it,
with the vocab-parallel loss, counted by the planner's meta forward.

Communication per micro-batch of b sequences of s tokens, hidden h, ``elem`` bytes per activation
element (counter units: an all-reduce of B bytes counts 2B), A = b s h elem:
- per block, as the vit's (``predict.block_collectives``): 2 all-reduces of A forward, 2 backward
  (SP: all-gathers and reduce-scatters, the column inputs gathered again backward);
- the embedding's g: one all-reduce of A forward (SP: then its gradient all-gathered backward, A);
- the head's f: one all-reduce of A backward (SP: its input all-gathered forward, reduce-scattered
  backward, A each);
- the cross-entropy: 3 all-reduces of b s fp32 values (the max, the sum of exp, the target logit).
Once per step under SP the LayerNorms' and row biases' gradients are summed; with replicas every
shard's gradient is averaged over them. strategy.cp (cp_rules.py): s = seq/cp, a rank's tokens, plus
the attention's bytes (``tp_context_comm``); every shard's gradient is averaged over the cp group too.
"""

from __future__ import annotations

import copy

from omegaconf import DictConfig
from torch import nn

from parallel_lab.strategies.cp.rules import add_comm
from parallel_lab.strategies.tp.cp_rules import tp_context_comm
from parallel_lab.strategies.tp.predict import (
    _sharded_numels,
    activation_elem,
    block_collectives,
    predict_tp_memory,
    recompute_mode,
)

LOSS_REDUCES = 3  # the cross-entropy's all-reduces: max, sum of exp, target logit


def predict_gpt_memory(cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, int]:
    from parallel_lab.strategies.tp.megatron import vit_plan
    from parallel_lab.strategies.tp.vocab import vocab_layers

    return predict_tp_memory(cfg, model, vit_plan(model), rank, tuple(vocab_layers(model)))


def split_meta_gpt(cfg: DictConfig, model: nn.Module, rank: int) -> nn.Module:
    """A meta copy of the gpt split as tp rank ``rank % tp`` splits it (with strategy.cp, then
    sharded over the cp ranks as rank's cp coordinate shards it), its loss included
    (``vocab.WithVocabLoss``): on the meta device the collectives only shape their outputs."""
    from parallel_lab.strategies.tp.megatron import TPGroup
    from parallel_lab.strategies.tp.vocab import WithVocabLoss, split_gpt

    tp = TPGroup(None, rank % cfg.strategy.tp, cfg.strategy.tp)
    split = copy.deepcopy(model)
    split_gpt(split, tp, bool(cfg.strategy.get("sequence_parallel")))
    cp = cfg.strategy.get("cp") or 1
    if cp > 1:  # then sharded over the cp ranks as the run does (tp/strategy.py), this rank's tokens
        from parallel_lab.strategies.cp.comm import CPGroup
        from parallel_lab.strategies.cp.parallelize import parallelize

        parallelize(split, CPGroup(None, rank // cfg.strategy.tp % cp, cp), str(cfg.strategy.cp_impl))
    return WithVocabLoss(split, tp)


def gpt_comm_formula(
    batch: int,
    seq: int,
    hidden: int,
    layers: int,
    sequence_parallel: bool,
    elem: int = 4,
    recompute: str = "none",
    dropout: float = 0.0,
) -> dict[str, float]:
    """Bytes per micro-batch one tp rank issues, tp > 1 (the module docstring's list)."""
    act = batch * seq * hidden * elem
    loss = LOSS_REDUCES * 2.0 * 4 * batch * seq  # fp32, whatever the forward's precision
    per_block = block_collectives(sequence_parallel, "manual", recompute, dropout)
    if not sequence_parallel:
        return {"all_reduce": (layers * per_block["all_reduce"] + 2) * 2.0 * act + loss}
    return {
        "all_gather_single": (layers * per_block["all_gather"] + 2) * float(act),  # + embed's, head's
        "reduce_scatter_single": (layers * per_block["reduce_scatter"] + 1) * float(act),  # + head's
        "all_reduce": 2.0 * act + loss,  # the embedding's g
    }


def predict_gpt_comm(cfg: DictConfig, model: nn.Module) -> dict[str, float]:
    """Per step: ``gpt_comm_formula`` per micro-batch, the SP weights' gradient sums once per step
    and, with replicas, the data-parallel gradient average."""
    from parallel_lab.models.gpt_sizes import gpt_sizes
    from parallel_lab.strategies.tp.megatron import sequence_parallel_params, vit_plan
    from parallel_lab.strategies.tp.vocab import vocab_layers

    s, tp, accum = cfg.strategy, cfg.strategy.tp, cfg.trainer.grad_accum
    if cfg.world_size < 2:
        return {}
    if tp < 2:
        return {"all_reduce": 2.0 * 4 * sum(p.numel() for p in model.parameters())}  # plain data parallel
    sizes, replicate, cp = gpt_sizes(cfg.model), s.get("replicate") or 1, s.get("cp") or 1
    sp = bool(s.get("sequence_parallel"))
    batch = cfg.trainer.global_batch // accum // replicate
    formula = gpt_comm_formula(
        batch, sizes["seq"] // cp, sizes["hidden"], sizes["layers"], sp, activation_elem(cfg), recompute_mode(cfg),
        sizes["dropout"],
    )  # fmt: skip
    comm = {op: n * accum for op, n in formula.items()}  # strategy.cp: a rank's seq/cp tokens, and what cp adds
    comm = add_comm(comm, tp_context_comm(cfg, model))
    if sp:
        params = dict(model.named_parameters())
        comm["all_reduce"] += 2.0 * 4 * sum(params[n].numel() for n in sequence_parallel_params(model))
    groups = (replicate > 1) + (cp > 1)  # the gradient average: over the cp group, then the replicas
    if groups:
        sharded = _sharded_numels(model, vit_plan(model), tp, 0, tuple(vocab_layers(model)))
        comm["all_reduce"] += groups * 2.0 * 4 * sum(sharded)
    return comm


def gpt_split_layers(model: nn.Module) -> list[str]:
    """The layers whose FLOPs a tp rank divides by tp: the blocks' split Linears and attention cores,
    and the head (its projection over V/t of the vocabulary)."""
    from parallel_lab.strategies.tp.megatron import blocks, vit_plan

    plan = vit_plan(model)
    return [layer for pair in plan for layer in pair] + [f"{b}.attn.core" for b in blocks(model)] + ["head"]


def gpt_collective_calls(cfg: DictConfig, model: nn.Module) -> int:
    """Calls per step of the collectives (each kind, as the vit's count): 4 per block, the
    embedding's and the head's, the loss's 3, per micro-batch."""
    from parallel_lab.strategies.tp.megatron import blocks

    return (4 * len(blocks(model)) + 2 + LOSS_REDUCES) * cfg.trainer.grad_accum
