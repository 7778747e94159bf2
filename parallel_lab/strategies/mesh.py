"""One device mesh for every layout: ``MeshDims`` says how many ways the world is split along each
dimension (data-parallel ``replicate`` and ``shard``, context ``cp``, pipeline ``pp``, tensor ``tp``); a strategy
declares its dims from its options (``PlanRules.dims``) and a dp x tp x pp layout is one more
``MeshDims``, not new mesh code.

Ranks are laid out row-major, as ``init_device_mesh`` does, over the dims larger than 1 in the fixed
order ``DIM_ORDER``: data parallelism outside, model parallelism inside, so each group of the
innermost dimension is a run of consecutive ranks (on several nodes: the ranks of one host, where
the bandwidth is) and each ``replicate`` group takes one rank from every run (the traffic that
crosses hosts). The product of the dims is world_size, checked in the parent (``check_degrees``).

Data parallelism over the replicate dimension is plain gradient averaging: every replica gets
global_batch / replicate samples, and after backward each rank all-reduces its gradients (a local
shard of them, for FSDP and tp) with the ranks holding the same part of the model in the other
replicas, then divides by replicate. HSDP does this inside FSDP2; tp and pp call
``average_gradients``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError

if TYPE_CHECKING:  # MeshDims and check_degrees are the parent's (torch-free) rules; Mesh runs in a rank
    import torch

    from parallel_lab.comm.counter import CommCounter

REPLICATE = "replicate"  # the mesh dimension data parallelism runs over, in every layout
TENSOR = "tp"  # the mesh dimension of tensor parallelism, and the strategy.<key> of its degree
# Outermost first. Data parallelism outside model parallelism: a pipeline or a tp group is a run of
# consecutive ranks (the layouts of dp x pp and dp x tp keep the rank numbering they always had).
# Context parallelism (cp) sits with the data-parallel dims: its ranks read the same samples, each a
# slice of their tokens, and their gradients are averaged like data parallelism's (torchtitan's FSDP
# shards over shard x cp).
DIM_ORDER = (REPLICATE, "shard", "cp", "pp", TENSOR)


@dataclass(frozen=True)
class MeshDims:
    """How many ways the world is split along each mesh dimension (1 = not split)."""

    replicate: int = 1  # data-parallel replicas (each holds the whole model state, or one shard group's)
    shard: int = 1  # data-parallel ranks one copy of the model state is sharded over (FSDP)
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sample's tokens (strategies/cp)
    pp: int = 1  # pipeline stages
    tp: int = 1  # tensor-parallel degree
    # Expert-parallel degree: the MoE experts are sharded over ep of the data-parallel ranks, so it
    # divides replicate x shard and is no factor of the world (strategies/ep/groups.py).
    ep: int = 1
    # Dims laid out even at size 1: the groups the strategy's code talks over (tp's f/g, a
    # pipeline's sends), which must stay this rank's own and not become the world.
    named: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return math.prod(getattr(self, name) for name in DIM_ORDER)

    @property
    def data_parallel_size(self) -> int:
        """How many ways the global batch is split: every replicate and shard rank reads its own samples."""
        return self.replicate * self.shard

    def sizes(self) -> dict[str, int]:
        """{name: size} of the dims the mesh is built over (larger than 1, or named), outermost first."""
        return {name: getattr(self, name) for name in DIM_ORDER if getattr(self, name) > 1 or name in self.named}

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate along every dimension (0 along the unsplit ones), row-major."""
        coords = dict.fromkeys(DIM_ORDER, 0)
        for name, size in reversed(self.sizes().items()):
            coords[name], rank = rank % size, rank // size
        return coords

    def dp_rank(self, rank: int) -> int:
        """Which share of the global batch ``rank`` reads."""
        c = self.coords(rank)
        return c[REPLICATE] * self.shard + c["shard"]

    def group_ranks(self, rank: int, name: str) -> list[int]:
        """The global ranks of ``rank``'s group along dimension ``name``: the ranks whose other
        coordinates are ``rank``'s."""
        sizes = self.sizes()
        if name not in sizes:
            return [rank]  # not split along it: alone
        stride = math.prod(list(sizes.values())[list(sizes).index(name) + 1 :])
        base = rank - self.coords(rank)[name] * stride
        return [base + k * stride for k in range(sizes[name])]

    def metrics(self) -> dict[str, int] | None:
        """metrics.json's ``strategy_extras.mesh.dims``: the mesh's dimensions, None for a flat world."""
        sizes = self.sizes()
        return sizes if len(sizes) > 1 else None


def check_degrees(cfg: DictConfig, dims: MeshDims, keys: dict[str, tuple[str, str]]) -> None:
    """One line when the dims do not multiply to world_size, saying what multiplies to what.
    ``keys``: dimension -> (its strategy.<key>, what it counts), beside the replicate degree."""
    replicate = dims.replicate
    if replicate < 1:
        raise ConfigError(
            f"strategy.replicate={replicate} must be >= 1 (1 = no data parallelism); e.g. strategy.replicate=2"
        )
    world = cfg.world_size
    if dims.world != world:
        inner = dims.world // replicate
        terms = [f"strategy.replicate={replicate}"] + [
            f"strategy.{key}={getattr(dims, d)}" for d, (key, _) in keys.items()
        ]
        what = ["data-parallel replicas"] + [w for _, w in keys.values()]
        fix = f"set world_size={dims.world}"
        if world % inner == 0:
            fix += f" or strategy.replicate={world // inner}"
        raise ConfigError(
            f"{' x '.join(terms)} = {dims.world} is not world_size={world} ({' x '.join(what)} = world_size); {fix}"
        )


class Mesh:
    """The device mesh of one run (collective to build: every rank of the world builds it), with
    each dimension's process group counted under the dimension's name."""

    def __init__(self, dims: MeshDims, device_type: str, counter: CommCounter) -> None:
        self.dims = dims
        self.device_mesh = None
        sizes = dims.sizes()
        if len(sizes) > 1:  # one split dimension is the world itself: its default group
            from torch.distributed.device_mesh import init_device_mesh

            self.device_mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
            for name in sizes:
                counter.label_group(self.device_mesh.get_group(name), name)

    def group(self, name: str):
        """This rank's process group along ``name``; None: the whole world (a flat layout), or no
        such dimension (not split, not named)."""
        if self.device_mesh is None or name not in self.dims.sizes():
            return None
        return self.device_mesh.get_group(name)

    def sub_mesh(self, name: str):
        """The 1-D DeviceMesh of dimension ``name`` (DTensor layouts), None in a flat layout."""
        return None if self.device_mesh is None else self.device_mesh[name]


def average_gradients(params: Iterable[torch.nn.Parameter], group, size: int) -> None:
    """Average the gradients over a replicate group: one all-reduce of all of them (a flat copy:
    one collective instead of one per tensor), then / size. A DTensor's local shard is averaged
    with the same shard of the other replicas."""
    import torch
    import torch.distributed as dist

    from parallel_lab.strategies.memory import local_tensor

    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
