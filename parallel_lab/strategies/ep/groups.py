"""Which ranks hold which experts (torchtitan's and DeepSpeed's layout): expert parallelism spans the
data-parallel ranks. The dp ranks (``MeshDims.dp_rank``) of one model-parallel position (the same
cp, pp and tp coordinates) are cut into blocks of ``ep`` consecutive dp ranks; each block holds every
expert once, E / ep on each rank (its ``ep group``, the all-to-all's group), and the ranks at the
same place of every block hold the same experts (its ``expert replicas``: dp / ep of them, over
which the experts' gradients are summed, as the dense ones are over every dp rank)."""

from __future__ import annotations

from parallel_lab.strategies.mesh import MeshDims


def _same_position(dims: MeshDims, rank: int) -> list[int]:
    """The ranks with ``rank``'s model-parallel coordinates, by dp rank."""
    mine = dims.coords(rank)
    ranks = [r for r in range(dims.world) if all(dims.coords(r)[d] == mine[d] for d in ("cp", "pp", "tp"))]
    return sorted(ranks, key=dims.dp_rank)


def ep_rank(dims: MeshDims, rank: int) -> int:
    """Which share of the experts ``rank`` holds: its place in its ep group."""
    return dims.dp_rank(rank) % dims.ep


def ep_group_ranks(dims: MeshDims, rank: int) -> list[int]:
    """The ranks that together hold every expert once, ``rank`` among them."""
    ranks, block = _same_position(dims, rank), dims.dp_rank(rank) // dims.ep
    return ranks[block * dims.ep : (block + 1) * dims.ep]


def replica_ranks(dims: MeshDims, rank: int) -> list[int]:
    """The ranks holding the same experts as ``rank`` (one per ep group)."""
    return _same_position(dims, rank)[ep_rank(dims, rank) :: dims.ep]


def all_groups(dims: MeshDims, kind) -> list[list[int]]:
    """Every group of one kind (ep_group_ranks or replica_ranks), each once, in a fixed order: every
    rank must create every group, in the same order (``dist.new_group``)."""
    seen: list[list[int]] = []
    for r in range(dims.world):
        g = kind(dims, r)
        if g not in seen:
            seen.append(g)
    return seen
