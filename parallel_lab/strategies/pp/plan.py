"""How the model is cut into pipeline chunks: contiguous runs of its top-level blocks, balanced by
``strategy.balance`` (each block's parameters, FLOPs or measured time). With
``strategy.virtual_stages=v`` the model is cut into stages x v chunks and rank s holds chunks
s, s + p, s + 2p, ... (interleaved, arXiv 2104.04473); v = 1: one chunk (stage) per rank."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
from torch import nn

from parallel_lab.models.flops import layer_flops
from parallel_lab.strategies.pp.cuts import check_cut, group_blocks


def cuttable_blocks(model: nn.Sequential) -> list[list[str]]:
    """Top-level children grouped into blocks that can start a stage (chunks.py ``group_blocks``)."""
    return group_blocks((name, any(True for _ in child.parameters())) for name, child in model.named_children())


def block_costs(model: nn.Sequential, balance: str, block_times: Sequence[float] = ()) -> list[float]:
    """Each cuttable block's cost under ``balance``: params (its parameter count), flops (its
    forward FLOPs, models/flops.py: backward is about twice forward for every layer, so the same
    split) or time (``block_times``, measured forward+backward seconds, pp/timing.py)."""
    blocks = cuttable_blocks(model)
    if balance == "time":
        return [float(t) for t in block_times]
    if balance == "params":
        return [float(sum(p.numel() for n in b for p in model.get_submodule(n).parameters())) for b in blocks]
    flops = layer_flops(model, 1)
    return [sum(f for name, f in flops.items() if name.split(".")[0] in b) for b in blocks]


def balanced_cuts(sizes: Sequence[float], parts: int) -> list[int]:
    """Block indices where parts 2..n start, minimising the largest part's cost (exhaustive:
    models here have few blocks; the first best in lexicographic order, so every rank agrees)."""
    best, best_cost = [], None
    for cuts in itertools.combinations(range(1, len(sizes)), parts - 1):
        bounds = (0, *cuts, len(sizes))
        cost = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best_cost is None or cost < best_cost:
            best, best_cost = list(cuts), cost
    return best


def plan_stages(
    model: nn.Sequential, stages: int, cuts: list[str], costs: Sequence[float] | None = None, virtual: int = 1
) -> list[list[str]]:
    """Child names of each of the stages x virtual chunks, in model order (chunk c on rank c % stages).
    ``costs``: per cuttable block (``block_costs``); None: by parameter count. Raises ConfigError
    for an impossible cut."""
    blocks = cuttable_blocks(model)
    index = check_cut(blocks, stages, list(cuts), virtual)
    if not cuts:
        index = balanced_cuts(costs if costs is not None else block_costs(model, "params"), stages * virtual)
    bounds = (0, *index, len(blocks))
    return [[name for b in blocks[a:e] for name in b] for a, e in zip(bounds, bounds[1:])]


def chunk_plan(opts, model: nn.Sequential) -> list[list[str]]:
    """The cut a run makes from its validated ``strategy`` options: every chunk, in model order."""
    costs = block_costs(model, opts.balance, list(opts.block_times))
    return plan_stages(model, opts.stages, list(opts.cuts), costs, opts.get("virtual_stages", 1))


def rank_chunks(opts, rank: int) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in model order."""
    p, v = opts.stages, opts.get("virtual_stages", 1)
    return [c * p + rank % p for c in range(v)]


def stage_shares(stages: list[nn.Module]) -> list[float]:
    """Each pipeline stage's share of the model's FLOPs (stages run in order on meta tensors, the
    first fed the model's input: an image, or token ids)."""
    from parallel_lab.models import input_shape, sample_input

    x = sample_input(stages[0], 1, input_shape(stages[0]))
    per_stage = []
    for stage in stages:
        per_stage.append(sum(layer_flops(stage, 1, tuple(x.shape[1:])).values()))
        with torch.no_grad():
            x = stage(x)
    total = sum(per_stage)
    return [f / total for f in per_stage]
