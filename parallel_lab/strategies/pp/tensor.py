"""dp x pp x tp: Megatron's split of the vit's blocks inside each pipeline stage
(``strategy=pp strategy.tp=T``, Narayanan et al., arXiv 2104.04473, sec. 2.3: tensor parallel
inside a node, the pipeline across). docs/meshes.md.

Ranks: rank = (replica x stages + stage) x tp + tp rank (``strategies/mesh.py``): the tp group of a
stage is a run of T consecutive ranks; a pipeline takes one rank of every stage's tp group, the ones
with its tp coordinate (T apart). Stage s's tp rank t sends its activation to stage s + 1's tp rank
t: with plain Megatron both hold the whole activation (the same on every tp rank, after the
sublayer's all-reduce); with sequence parallelism the tokens of tp rank t, the p2p payload / T.

What the stage does for tp is the tp strategy's (``tp/strategy.py``): the blocks split by
``split_transformer`` on the mesh's tp group, every tp rank of the last stage computes the same
loss (reported and counted once), the full gradient's norm sums the shards' squares over the tp
group and the replicated parameters' once, the SP weights' gradients summed over the tp group, and
the full parameters gathered along each shard's split dimension.

Here: the parent's refusals, the planner's meta copy of a rank's split stage, and the runtime
helpers the pp strategy calls."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from parallel_lab.strategies.memory import local_tensor
from parallel_lab.strategies.pp.tied import counted_once


def tp_coords(cfg: DictConfig, rank: int) -> tuple[int, int]:
    """(tp rank, tp degree) of ``rank`` on the pp mesh: tp is its innermost dimension (mesh.DIM_ORDER)."""
    tp = cfg.strategy.get("tp", 1)
    return rank % tp, tp


def split_meta_stage(cfg: DictConfig, module: nn.Module, rank: int) -> nn.Module:
    """A meta copy of ``module`` (a rank's stage or one chunk of it) as tp rank ``rank``'s split
    holds it (the run's manual split; on the meta device its collectives only shape their
    outputs); ``module`` itself when tp = 1."""
    from parallel_lab.strategies.tp.megatron import TPGroup
    from parallel_lab.strategies.tp.split import split_transformer

    t, tp = tp_coords(cfg, rank)
    if tp == 1:
        return module
    split = copy.deepcopy(module)
    split_transformer(split, TPGroup(None, t, tp), bool(cfg.strategy.get("sequence_parallel")))
    return split


def boundary_shape(shape: torch.Size, g: int, tp: int, sequence_parallel: bool) -> torch.Size:
    """Chunk g's input as a tp rank receives it: under SP (after the embed, g > 0) its tokens only."""
    if not sequence_parallel or g == 0:
        return shape
    from parallel_lab.strategies.tp.megatron import TOKENS

    return torch.Size([*shape[:TOKENS], shape[TOKENS] // tp, *shape[TOKENS + 1 :]])


def clip_over_stages_and_tp(pipe, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / ||g||), ||g|| of the whole model's gradient: each
    rank adds the squares of its shards and (on tp rank 0 only: every tp rank holds them) of its
    replicated parameters, summed over the tp group, then over the pipeline (a tied embedding's
    copies once). Float64 sums."""
    named = [(n, p.grad) for n, p in pipe.model.named_parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=pipe.device)
    for name, g in named:
        if (name in pipe.shard_dims or pipe.tp_rank == 0) and counted_once(pipe, name):
            sq += local_tensor(g).double().pow(2).sum()
    if pipe.opts.tp > 1:
        dist.all_reduce(sq, group=pipe.tp_group)
    dist.all_reduce(sq, group=pipe.group)
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    for _, g in named:
        g.mul_(coef.to(g.dtype))


def sum_sequence_parallel_grads(pipe) -> None:
    """SP: the LayerNorms, row biases and head norm saw this rank's tokens only; their gradient is
    the sum over the tp group (one all-reduce of them all, flattened), as tp/strategy.py does."""
    grads = [p.grad for p in pipe.sp_params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=pipe.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def gathered_stage(pipe) -> list[tuple[str, torch.Tensor]]:
    """The stage's (name, parameter) pairs, CPU, the split ones all-gathered over the tp group and
    concatenated along their split dimension (collective over the tp group when tp > 1)."""
    pairs = []
    for name, p in pipe.model.named_parameters():
        local = local_tensor(p.detach()).contiguous()
        if name in pipe.shard_dims:
            parts = [torch.empty_like(local) for _ in range(pipe.opts.tp)]
            dist.all_gather(parts, local, group=pipe.tp_group)
            local = torch.cat(parts, dim=pipe.shard_dims[name])
        pairs.append((name, local.cpu()))
    return pairs


def local_part(pipe, name: str, full: torch.Tensor) -> torch.Tensor:
    """This tp rank's chunk of a split parameter (``tp/layers.py``'s cut), the whole tensor else."""
    if name not in pipe.shard_dims:
        return full
    return full.chunk(pipe.opts.tp, pipe.shard_dims[name])[pipe.tp_rank].contiguous()


def stage_tp_comm(cfg: DictConfig, stage: nn.Module, tokens_shape: torch.Size, accum: int) -> dict[str, float]:
    """One step's tp collectives of a split stage (``stage``: its meta split), counter units (an
    all-reduce of B bytes counts 2B; an all-gather its output, a reduce-scatter its input), for
    the (batch, tokens, dim) activation A of the step: per block ``tp/predict.py``'s
    ``block_collectives`` of A (the manual split); SP: the embed's gradient gathered (A), the
    head's pool all-reduced and the SP weights' gradients once per step (tp/predict.py's formula,
    per stage)."""
    from parallel_lab.models import vit_sizes
    from parallel_lab.strategies.tp.megatron import blocks, sequence_parallel_params
    from parallel_lab.strategies.tp.predict import activation_elem, block_collectives, recompute_mode

    elem = activation_elem(cfg)  # bf16: the activations and their gradients; the weights' gradients stay fp32
    act, depth = elem * tokens_shape.numel(), len(blocks(stage))
    sp = bool(cfg.strategy.get("sequence_parallel"))
    per_block = block_collectives(sp, "manual", recompute_mode(cfg), vit_sizes(cfg.model)["dropout"])
    if not sp:
        return {"all_reduce": accum * depth * per_block["all_reduce"] * 2 * act}
    names = dict(stage.named_parameters())
    comm = {
        "all_gather_single": accum * (depth * per_block["all_gather"] + hasattr(stage, "embed")) * act,
        "reduce_scatter_single": accum * depth * per_block["reduce_scatter"] * act,
        "all_reduce": 2.0 * 4 * sum(names[n].numel() for n in sequence_parallel_params(stage)),
    }
    if hasattr(stage, "head"):
        comm["all_reduce"] += accum * 2.0 * elem * tokens_shape[0] * tokens_shape[-1]
    return {op: n for op, n in comm.items() if n}


def tp_flop_fraction(chunk: nn.Module, input_shape: tuple, tp: int) -> float:
    """The part of ``chunk``'s forward FLOPs a tp rank computes: its blocks' split Linears and
    attention cores (heads / tp) divided by tp, embed and head whole (as tp/predict.py ``tp_share``)."""
    from parallel_lab.models.flops import layer_flops
    from parallel_lab.strategies.tp.megatron import blocks, vit_plan

    flops = layer_flops(chunk, 1, input_shape)
    split_names = {n for pair in vit_plan(chunk) for n in pair} | {f"{b}.attn.core" for b in blocks(chunk)}
    split = sum(f for name, f in flops.items() if name in split_names)
    total = sum(flops.values())
    return (total - split + split / tp) / total if total else 1.0
