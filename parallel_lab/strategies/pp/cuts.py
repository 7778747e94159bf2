"""Which cuts of the model into pipeline chunks exist, from ``model.*`` alone (torch-free: the parent
refuses an impossible cut before importing torch): the model's cuttable blocks (its top-level
children grouped so every block holds weights, models/layout.py) and the checks of
strategy.stages x strategy.virtual_stages and strategy.cuts against them. ``plan.py`` cuts the
meta model with the same grouping and checks."""

from __future__ import annotations

from typing import Iterable

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError


def group_blocks(children: Iterable[tuple[str, bool]]) -> list[list[str]]:
    """Top-level children (name, holds parameters) grouped into blocks that can start a stage: a
    child without parameters (ReLU, Flatten, pooling) stays with the block before it, so no stage
    is left without weights."""
    blocks: list[list[str]] = []
    for name, has_params in children:
        if has_params or not blocks:
            blocks.append([name])
        else:
            blocks[-1].append(name)
    return blocks


def config_blocks(cfg: DictConfig) -> list[list[str]]:
    """The model's cuttable blocks from model.* alone (torch-free, models/layout.py): the meta
    model's (``plan.cuttable_blocks``)."""
    from parallel_lab.models.layout import children

    return group_blocks(children(cfg.model))


def block_label(block: list[str]) -> str:
    return "+".join(block)


def check_cut(blocks: list[list[str]], stages: int, cuts: list[str], virtual: int = 1) -> list[int]:
    """Refuse a cut of these blocks into stages x virtual chunks that cannot exist (ConfigError);
    returns the block indices where the given ``cuts`` start chunks 2..n ([] when none given:
    then any balance cuts the blocks)."""
    parts = stages * virtual
    what = f"strategy.stages={stages}" + (f" x strategy.virtual_stages={virtual}" if virtual > 1 else "")
    if parts > len(blocks):
        fix = f"strategy.stages x strategy.virtual_stages<={len(blocks)}" if virtual > 1 else ""
        raise ConfigError(
            f"{what} is more than the {len(blocks)} cuttable blocks of this model "
            f"({', '.join(block_label(b) for b in blocks)}); use {fix or f'strategy.stages<={len(blocks)}'}"
        )
    return _given_cuts([b[0] for b in blocks], list(cuts), parts, what) if cuts else []


def _given_cuts(starts: list[str], cuts: list[str], parts: int, what: str) -> list[int]:
    if len(cuts) != parts - 1:
        raise ConfigError(f"strategy.cuts={list(cuts)} must name {parts - 1} blocks for {what} (or be [])")
    bad = [c for c in cuts if c not in starts[1:]]
    if bad:
        raise ConfigError(
            f"strategy.cuts names '{bad[0]}', which cannot start a stage; choose from {', '.join(starts[1:])}"
        )
    index = [starts.index(c) for c in cuts]
    if index != sorted(set(index)):
        raise ConfigError(f"strategy.cuts={list(cuts)} must be in model order without repeats")
    return index
