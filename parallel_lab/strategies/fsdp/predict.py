"""What FSDP2 (``fully_shard``) will hold and send, from the model's shapes alone (``parallel_lab.plan``).

FSDP2 shards every parameter on its dim 0 the way ``torch.chunk`` does: each of N ranks gets
ceil(d0 / N) rows, the last ranks fewer or none, and every rank's shard *storage* is padded to the
full ceil(d0 / N) rows (so all-gathers and reduce-scatters are equal-sized). Per parameter of shape
(d0, rest...) on rank r:

- parameter storage: the padded shard, ceil(d0/N) x rest elements (plus, for ``grad_op``, the
  gathered full tensor kept from forward to backward: N x the padded shard);
- gradient: the reduce-scatter output, the same padded shard size;
- optimizer state: Adam's moments are ``zeros_like`` of the *unpadded* local shard (rows rank r
  really holds); the scalar step counters are not counted (this strategy's measurement skips 0-d).

Communication per step (counter units, comm/counter.py): every unit all-gathers its padded full
parameters before forward (and, ``full``, again before backward) and reduce-scatters its padded
full gradients once; ``no_shard`` all-reduces the gradients over the replicate dimension instead.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from parallel_lab.strategies.memory import chunk_rows, predicted_optimizer_bytes


def _shard_world(cfg: DictConfig) -> int:
    """Ranks one parameter is sharded over: all, one (no_shard), or a shard group (hybrid = HSDP)."""
    if cfg.strategy.sharding == "no_shard":
        return 1
    if cfg.strategy.sharding == "hybrid":
        return cfg.world_size // (cfg.strategy.get("replicate") or 1)
    return cfg.world_size


def shard_layout(model: torch.nn.Module, world: int, rank: int) -> list[tuple[int, int]]:
    """(padded shard numel, numel rank holds) of every parameter, in model order."""
    layout = []
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        rest = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        held, per = chunk_rows(rows, world, rank)
        layout.append((per * rest, held * rest))
    return layout


def predict_fsdp2_memory(cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int]:
    world = _shard_world(cfg)
    layout = shard_layout(model, world, rank % world)
    padded = 4 * sum(p for p, _ in layout)
    report = {"param_bytes": padded, "master_param_bytes": 0, "grad_bytes": padded}
    if cfg.strategy.sharding == "grad_op":
        # The gathered (padded, full) working copy stays alive from forward until backward; in
        # bf16 (MixedPrecisionPolicy param_dtype) it is gathered as bf16, half the bytes.
        working = padded * world // (2 if _bf16(cfg) else 1)
        report.update(param_bytes=working, master_param_bytes=padded)
    report["optim_bytes"] = predicted_optimizer_bytes((h for _, h in layout), cfg.trainer, step_counters=False)
    return report


def _bf16(cfg: DictConfig) -> bool:
    return cfg.strategy.get("mixed_precision", "fp32") == "bf16"


def predict_fsdp2_comm(cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float]:
    if cfg.world_size < 2:
        return {}
    if cfg.strategy.sharding == "hybrid":
        return None  # HSDP's two dimensions are not predicted (docs/meshes.md measures them)
    full_padded = 4 * sum(p for p, _ in shard_layout(model, cfg.world_size, rank)) * cfg.world_size
    sharding = cfg.strategy.sharding
    if sharding == "no_shard":
        return {"all_reduce": 2.0 * 4 * sum(p.numel() for p in model.parameters())}
    gathers = 2 if sharding == "full" else 1
    # bf16: parameters are all-gathered in bf16; gradients are reduce-scattered in fp32 (reduce_dtype)
    gathered = full_padded // (2 if _bf16(cfg) else 1)
    return {"all_gather_single": float(gathers * gathered), "reduce_scatter_single": float(full_padded)}
