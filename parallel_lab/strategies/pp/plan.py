"""How the model is cut into pipeline stages: contiguous runs of its top-level blocks."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from parallel_lab.errors import ConfigError
from parallel_lab.models.flops import layer_flops


def cuttable_blocks(model: nn.Sequential) -> list[list[str]]:
    """Top-level children grouped into blocks that can start a stage: a child without parameters
    (ReLU, Flatten, pooling) stays with the block before it, so no stage is left without weights."""
    blocks: list[list[str]] = []
    for name, child in model.named_children():
        has_params = any(True for _ in child.parameters())
        if has_params or not blocks:
            blocks.append([name])
        else:
            blocks[-1].append(name)
    return blocks


def balanced_cuts(sizes: list[int], stages: int) -> list[int]:
    """Block indices where stages 2..p start, minimising the largest stage's parameter count
    (exhaustive: models here have fewer than ten blocks)."""
    best, best_cost = [], None
    for cuts in itertools.combinations(range(1, len(sizes)), stages - 1):
        bounds = (0, *cuts, len(sizes))
        cost = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best_cost is None or cost < best_cost:
            best, best_cost = list(cuts), cost
    return best


def block_label(block: list[str]) -> str:
    return "+".join(block)


def plan_stages(model: nn.Sequential, stages: int, cuts: list[str]) -> list[list[str]]:
    """Child names of each stage, in model order. Raises ConfigError for an impossible cut."""
    blocks = cuttable_blocks(model)
    if stages > len(blocks):
        raise ConfigError(
            f"strategy.stages={stages} is more than the {len(blocks)} cuttable blocks of this model "
            f"({', '.join(block_label(b) for b in blocks)}); use strategy.stages<={len(blocks)}"
        )
    starts = [b[0] for b in blocks]
    if cuts:
        if len(cuts) != stages - 1:
            raise ConfigError(
                f"strategy.cuts={list(cuts)} must name {stages - 1} blocks for strategy.stages={stages} (or be [])"
            )
        bad = [c for c in cuts if c not in starts[1:]]
        if bad:
            raise ConfigError(
                f"strategy.cuts names '{bad[0]}', which cannot start a stage; choose from {', '.join(starts[1:])}"
            )
        index = [starts.index(c) for c in cuts]
        if index != sorted(set(index)):
            raise ConfigError(f"strategy.cuts={list(cuts)} must be in model order without repeats")
    else:
        sizes = [sum(p.numel() for n in b for p in model.get_submodule(n).parameters()) for b in blocks]
        index = balanced_cuts(sizes, stages)
    bounds = (0, *index, len(blocks))
    return [[name for b in blocks[a:e] for name in b] for a, e in zip(bounds, bounds[1:])]


def stage_shares(stages: list[nn.Module]) -> list[float]:
    """Each pipeline stage's share of the model's FLOPs (stages run in order on meta tensors)."""
    x = torch.empty(1, 3, 32, 32, device="meta")
    per_stage = []
    for stage in stages:
        per_stage.append(sum(layer_flops(stage, 1, tuple(x.shape[1:])).values()))
        with torch.no_grad():
            x = stage(x)
    total = sum(per_stage)
    return [f / total for f in per_stage]
