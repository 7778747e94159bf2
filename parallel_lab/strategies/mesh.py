"""2-D device meshes: data parallelism (the ``replicate`` dimension) times one model-parallel
dimension (FSDP's ``shard``, tensor parallel ``tp``, pipeline ``pp``).

Ranks are laid out row-major, as ``init_device_mesh`` does: rank = r * inner + i, so each group of
the inner dimension is a run of consecutive ranks (on several nodes: the ranks of one host, where
the bandwidth is) and each replicate group takes one rank from every run (the traffic that crosses
hosts). ``strategy.replicate`` is the number of replicas; replicate x inner = world_size, checked
in the parent (``check_degrees``).

Data parallelism over the replicate dimension is plain gradient averaging: every replica gets
global_batch / replicate samples, and after backward each rank all-reduces its gradients (a local
shard of them, for FSDP and tp) with the ranks holding the same part of the model in the other
replicas, then divides by replicate. HSDP does this inside FSDP2; tp and pp call
``average_gradients``.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from parallel_lab.comm.counter import CommCounter
from parallel_lab.errors import ConfigError
from parallel_lab.strategies.memory import local_tensor

REPLICATE = "replicate"  # the mesh dimension data parallelism runs over, in every 2-D layout


def check_degrees(cfg: DictConfig, replicate: int, inner_key: str, inner: int, inner_what: str) -> None:
    """One line when replicate x inner != world_size, saying what multiplies to what."""
    if replicate < 1:
        raise ConfigError(
            f"strategy.replicate={replicate} must be >= 1 (1 = no data parallelism); e.g. strategy.replicate=2"
        )
    world = cfg.world_size
    if replicate * inner != world:
        fix = f"set world_size={replicate * inner}"
        if world % inner == 0:
            fix += f" or strategy.replicate={world // inner}"
        raise ConfigError(
            f"strategy.replicate={replicate} x strategy.{inner_key}={inner} = {replicate * inner} is not "
            f"world_size={world} (data-parallel replicas x {inner_what} = world_size); {fix}"
        )


def build_mesh(device_type: str, replicate: int, inner: int, inner_name: str, counter: CommCounter):
    """The (replicate, inner) DeviceMesh; the counter counts each dimension's traffic under its name.
    Collective: every rank of the world must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (replicate, inner), mesh_dim_names=(REPLICATE, inner_name))
    for name in mesh.mesh_dim_names:
        counter.label_group(mesh.get_group(name), name)
    return mesh


def average_gradients(params: Iterable[torch.nn.Parameter], group, size: int) -> None:
    """Average the gradients over a replicate group: one all-reduce of all of them (a flat copy:
    one collective instead of one per tensor), then / size. A DTensor's local shard is averaged
    with the same shard of the other replicas."""
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


class DataParallelReplicas:
    """Mixin for a model-parallel ``Strategy`` (tp, pp) that adds data parallelism over
    ``strategy.replicate`` copies of its model-parallel group: a (replicate, inner) mesh, gradients
    averaged over the replicate dimension before clipping and the optimizer step."""

    mesh2d = None  # the (replicate, inner) DeviceMesh; None when strategy.replicate = 1
    replicate_group = None  # this rank's group along the replicate dimension

    def build_replicas(self, inner: int, inner_name: str):
        """Build the mesh (collective); return this rank's inner group, None (the world) without replicas."""
        if self.opts.replicate == 1:
            return None
        self.mesh2d = build_mesh(self.device.type, self.opts.replicate, inner, inner_name, self.comm)
        self.replicate_group = self.mesh2d.get_group(REPLICATE)
        return self.mesh2d.get_group(inner_name)

    def running_stats_group(self) -> tuple[object, int] | None:
        """BatchNorm layers outside the split are the same in every replica, fed other samples:
        the first replica's running statistics are the ones kept (base.py sync_running_stats)."""
        if self.replicate_group is None:
            return None
        return self.replicate_group, dist.get_process_group_ranks(self.replicate_group)[0]

    def average_over_replicas(self) -> None:
        """Data parallelism: every replica saw its own global_batch / replicate samples."""
        average_gradients(self.model.parameters(), self.replicate_group, self.opts.replicate)

    def optimizer_step(self) -> None:
        self.average_over_replicas()
        super().optimizer_step()

    def mesh_dims(self) -> dict[str, int] | None:
        return None if self.mesh2d is None else dict(zip(self.mesh2d.mesh_dim_names, self.mesh2d.shape))

    def teardown(self) -> None:
        super().teardown()
        self.mesh2d = self.replicate_group = None
