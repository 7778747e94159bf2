"""Which of a run's bytes cross hosts: the "inter-host bytes per step" of metrics.json and the report.

Placement: ranks sit on hosts in blocks of ``launcher.nproc_per_node`` (host = rank // nproc_per_node),
which is how every multi-node launcher here numbers them (torchrun's node_rank x nproc_per_node +
local_rank, DeepSpeed's hostfile slots, MPICH's ``-f`` with ``host:N``, Slurm's block distribution).

Approximation, stated once: a rank's bytes on a process group (``comm_bytes_by_group``, counted by
``comm/counter.py`` in the ZeRO paper's units) count as inter-host when the group's ranks sit on more
than one host, and the figure is the busiest rank's. For a ring all-reduce over N ranks on H hosts in
host blocks, H of the ring's N links cross hosts and the last rank of each host sends its whole
2(N-1)/N share over one of them: so this is exact for that rank (the busiest across hosts), while the
hosts' total cross traffic is H/N of the group's. On a 2-D mesh the groups are computed from the
mesh (row-major, ``strategies/mesh.py``): HSDP's ``replicate`` groups take one rank per host block and
count, its ``shard`` groups stay inside a host and do not. Point-to-point traffic counted on the world
group (pipeline stages) counts as crossing when the world spans hosts: the stage boundary that
crosses is the busiest one. A group whose ranks cannot be told from its label counts as crossing
(an upper bound).
"""

from __future__ import annotations

import math

WORLD = "world"


def host_of(rank: int, nproc_per_node: int) -> int:
    return rank // nproc_per_node


def mesh_group(rank: int, dims: dict[str, int], name: str) -> list[int]:
    """The global ranks of ``rank``'s group along mesh dimension ``name`` (row-major layout)."""
    sizes = list(dims.values())
    d = list(dims).index(name)
    stride = math.prod(sizes[d + 1 :])
    base = rank - ((rank // stride) % sizes[d]) * stride
    return [base + k * stride for k in range(sizes[d])]


def group_ranks(label: str, rank: int, world: int, mesh_dims: dict[str, int] | None) -> list[int] | None:
    """The ranks of the group counted under ``label`` (counter.group_label), None if unknown."""
    if label == WORLD:
        return list(range(world))
    if mesh_dims and label in mesh_dims:
        return mesh_group(rank, mesh_dims, label)
    if label.startswith("ranks "):
        try:
            return [int(r) for r in label.removeprefix("ranks ").split(",")]
        except ValueError:
            return None
    return None


def spans_hosts(members: list[int], nproc_per_node: int) -> bool:
    return len({host_of(r, nproc_per_node) for r in members}) > 1


def inter_host_bytes_per_step(
    ranks: list[dict], nodes: int, nproc_per_node: int, mesh_dims: dict[str, int] | None = None
) -> float:
    """The busiest rank's bytes per step on groups that span hosts (0 on one node).
    ``ranks``: metrics.json's per-rank records (``rank``, ``comm_bytes_by_group``)."""
    if nodes <= 1 or not ranks:
        return 0.0
    world = len(ranks)
    busiest = 0.0
    for info in ranks:
        crossing = 0.0
        for label, nbytes in info.get("comm_bytes_by_group", {}).items():
            members = group_ranks(label, info["rank"], world, mesh_dims)
            if members is None or spans_hosts(members, nproc_per_node):
                crossing += nbytes
        busiest = max(busiest, crossing)
    return busiest
