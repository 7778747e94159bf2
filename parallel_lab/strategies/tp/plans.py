"""Megatron's per-block tensor-parallel split (Shoeybi et al., arXiv 1909.08053, sec. 3) as names:
which layers of a transformer block are column- and which row-parallel, and how they pair.
Torch-free: the parent reads the pairs off ``model.*`` (tp/rules.py ``config_split_plan``), a rank
off the built model (tp/megatron.py ``vit_plan``), with this one pairing."""

from __future__ import annotations

from typing import Callable

COLUMNS = ("attn.q", "attn.k", "attn.v", "mlp.fc1")  # in each block, split by output features
ROWS = ("attn.proj", "mlp.fc2")  # in each block, split by input features


def block_columns(has: Callable[[str], bool]) -> list[str]:
    """A transformer block's column-parallel layers, given which of its layers exist (``has``, a
    name within the block): q, k, v and, where its MLP is dense (it has mlp.fc1; an MoE MLP stays
    whole, its experts sharded by strategy.ep), fc1 (the gpt's swiglu MLP also its ``gate``, split
    as fc1 is: Llama's w1 and w3 are both column-parallel)."""
    if not has(COLUMNS[-1]):
        return list(COLUMNS[:-1])
    return [*COLUMNS[:-1], *(["mlp.gate"] if has("mlp.gate") else []), COLUMNS[-1]]


def block_plan(blocks: list[str], has: Callable[[str], bool]) -> list[tuple[str, str]]:
    """Megatron's (column, row) pairs of these blocks: per block q, k, v -> proj and fc1 (and the
    gpt's gate) -> fc2 (the last where the block's MLP is dense). ``has``: whether a layer, by its
    full name, exists."""
    return [
        (f"{b}.{c}", f"{b}.{ROWS[c.startswith('mlp.')]}")
        for b in blocks
        for c in block_columns(lambda name, b=b: has(f"{b}.{name}"))
    ]
