"""pp x cp in the parent: the refusals of ``strategy=pp strategy.cp``, the hand-off shapes, and
what the planner predicts of a stage's context parallelism (its attention's and pool's bytes, its
gradient average over the cp group, the cp-sharded meta copy of each chunk whose saved tensors are
the rank's activations). The runtime: ``pp/cp.py``. Torch-free at import.

The mesh is replicate x cp x pp (``strategies/mesh.py`` DIM_ORDER): a pipeline is the ranks of one
(replicate, cp) coordinate, a stage's cp group its ranks of one (replicate, pp); at world 4 with 2
stages and cp 2 the pipelines are {0, 1} and {2, 3}, the cp groups {0, 2} (stage 0) and {1, 3}."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.cp.rules import (
    WHOLE_ON_EVERY_CP_RANK,
    attention_comm,
    check_context,
    cp_of,
    pool_comm,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


def check_pp_cp(opts: DictConfig, cfg: DictConfig) -> None:
    """What pp x cp runs: the manual loop, one chunk per rank under gpipe or 1f1b, no tp, the
    hand-written ring or Ulysses; then cp's own rules (the model, its tokens and heads, fp32
    without dropout or recomputation)."""
    cp = opts.get("cp") or 1
    if cp == 1:
        return check_context(opts, cfg)  # cp < 1 refused there
    schedule, v, tp = str(opts.schedule), opts.virtual_stages, opts.get("tp", 1)
    fixes = (
        (str(opts.impl) != "manual", f"strategy.impl={opts.impl}", "strategy.impl=manual"),
        (schedule not in ("gpipe", "1f1b"), f"strategy.schedule={schedule}", "strategy.schedule=gpipe|1f1b"),
        (v > 1, f"strategy.virtual_stages={v}", "strategy.virtual_stages=1"),
        (tp > 1, f"strategy.tp={tp}", "strategy.tp=1 (cp x tp: strategy=fsdp or strategy=tp)"),
        (str(opts.cp_impl) == "deepspeed", "strategy.cp_impl=deepspeed", "strategy.cp_impl=ring|ulysses"),
    )
    for bad, what, fix in fixes:
        if bad:
            raise ConfigError(
                f"{what} with strategy=pp strategy.cp={cp} is not built (pp x cp runs the manual loop's gpipe "
                f"and 1f1b, one chunk a rank, without tp, ring or ulysses); use {fix} or strategy.cp=1"
            )
    check_context(opts, cfg)


def cp_coord(cfg: DictConfig, rank: int) -> int:
    """``rank``'s place in its stage's cp group."""
    from parallel_lab.strategies.pp.chunks import pp_dims

    return pp_dims(cfg.strategy).coords(rank)["cp"]


def cp_boundary(shape: torch.Size, g: int, cp: int) -> torch.Size:
    """Chunk g's input as a cp rank receives it: after the embedding (g > 0) its T/cp tokens,
    (batch, T/cp, hidden); chunk 0 reads the whole sample."""
    if cp < 2 or g == 0:
        return shape
    import torch

    return torch.Size([shape[0], shape[1] // cp, *shape[2:]])


def cp_meta_chunk(cfg: DictConfig, chunk: nn.Module, rank: int, first: bool, last: bool) -> nn.Module:
    """A meta copy of ``chunk`` as ``rank`` runs it under cp (``pp/cp.py`` ``parallelize_stage``;
    on the meta device its collectives only shape their outputs); ``chunk`` itself at cp = 1."""
    cp = cp_of(cfg)
    if cp < 2:
        return chunk
    from parallel_lab.strategies.cp.comm import CPGroup
    from parallel_lab.strategies.pp.cp import parallelize_stage

    copied = copy.deepcopy(chunk)
    parallelize_stage(copied, cfg, CPGroup(None, cp_coord(cfg, rank), cp), first, last)
    return copied


def cp_flop_fraction(cfg: DictConfig, chunk: nn.Module, input_shape: tuple) -> float:
    """The part of ``chunk``'s forward FLOPs (models/flops.py) a cp rank computes: 1/cp of every
    layer but the vit's ``WHOLE_ON_EVERY_CP_RANK`` (the patch convolution, the classifier after the
    pool), as ``cp/rules.py`` ``context_flop_share`` counts the whole model."""
    from parallel_lab.models.flops import layer_flops

    whole = WHOLE_ON_EVERY_CP_RANK if cfg.model.name == "vit" else ()
    flops = layer_flops(chunk, 1, input_shape)
    total = sum(flops.values())
    mine = sum(f / (1 if name in whole else cp_of(cfg)) for name, f in flops.items())
    return mine / total if total else 1.0


def stage_context_comm(cfg: DictConfig, stage: nn.Module, last: bool) -> dict[str, float]:
    """Bytes per step one cp rank of a stage sends for cp (comm/counter.py's units), b the
    pipeline's per-step batch (global batch / accumulation / replicate: the m micro-batches' bytes
    add up to it), t = T/cp the rank's tokens, K = b*t*kv_width*4 its keys (the vit's: K = Q =
    b*t*h*4): per block of the stage the ring's 3*(cp-1)*2K by ``isend`` (forward K and V, backward
    K, V and dK, dV) or Ulysses' 2*(2Q + 2K) by ``all_to_all_single``; on the vit's last stage the
    pool's all-reduce of (b, h), counted 2*b*h*4; and the stage's gradients averaged over its cp
    group, one all-reduce of them (counted 2*4 a parameter)."""
    from parallel_lab.strategies.cp.parallelize import blocks

    if cp_of(cfg) < 2:
        return {}
    replicas = cfg.strategy.get("replicate") or 1
    comm = attention_comm(cfg, len(blocks(stage)), replicas)
    pool = pool_comm(cfg, replicas) if last and cfg.model.name == "vit" else 0
    comm["all_reduce"] = float(pool + 2 * 4 * sum(p.numel() for p in stage.parameters()))
    return {op: n for op, n in comm.items() if n}
