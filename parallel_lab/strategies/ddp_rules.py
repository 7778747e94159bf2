"""``ddp``'s options (``DDPOptions``) and parent-side rules (``DDPPlan``): torch-free at import, the
parent reads them before any process starts (strategies/planning.py). The runtime: ``ddp.py``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.choices import Precision
from parallel_lab.errors import ConfigError
from parallel_lab.models.specs import sample_shape
from parallel_lab.strategies.cp.rules import (
    ContextOptions,
    add_comm,
    check_context,
    context_comm,
    context_flop_share,
    context_meta,
    cp_of,
)
from parallel_lab.strategies.ep.rules import balanced_comm, check_ep, ep_degree, expert_ids, expert_parallel_meta
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import ComputeShape, SavedBytes
from parallel_lab.strategies.registry import register_rules
from parallel_lab.strategies.replicated_rules import ReplicatedPlan

if TYPE_CHECKING:
    from torch import nn


@dataclass
class DDPOptions(ContextOptions, StrategyOptions):
    """``strategy=ddp`` options (with ``strategy.cp``/``cp_impl``: context parallelism, strategies/cp)."""

    bucket_cap_mb: float = 25.0  # gradients are all-reduced in buckets of this many MiB (> 0)
    gradient_as_bucket_view: bool = True  # grads live inside the buckets: no extra gradient copy
    # fp32 | bf16: forward/backward on a bf16 copy of the fp32 weights, gradients all-reduced in
    # fp32 (strategies/precision.py)
    precision: Precision = Precision.fp32
    # Expert parallelism (model.moe_experts > 0): the MoE experts sharded over ep data-parallel
    # ranks, tokens exchanged by all-to-all (strategies/ep/, docs/moe.md); divides world_size
    # and model.moe_experts. 1 = every rank holds every expert.
    ep: int = 1


@register_rules("ddp")
class DDPPlan(ReplicatedPlan):
    Options = DDPOptions
    syncs_batchnorm = True  # every rank reads its own samples
    weight_copies = True  # strategy.precision=bf16: Bf16Compute
    allreduce_variants = {"ddp": []}  # torch's reducer: bucketed, from backward hooks

    @classmethod
    def comm_theory_psi(cls, cfg: DictConfig) -> float | None:
        """One all-reduce of every gradient per step; with cp the attention's bytes too, which are
        no multiple of Ψ: the report takes the planner's bytes (``predict_comm``) instead."""
        return 2.0 if cp_of(cfg) < 2 and ep_degree(cfg) == 1 else None  # under ep: the run's routing (ddp.py)

    @classmethod
    def dims(cls, cfg: DictConfig) -> MeshDims:
        """world_size / cp data-parallel replicas, each a group of cp consecutive ranks."""
        cp = cp_of(cfg)
        return MeshDims(replicate=cfg.world_size // cp, cp=cp, ep=ep_degree(cfg))

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, float]:
        """The gradients' all-reduce over every rank, plus context parallelism's bytes (cp/rules.py).
        Under ep: the dense gradients only, and the exchanges with every expert equally loaded
        (strategies/ep/rules.py; the run records its routing's own)."""
        comm = super().predict_comm(cfg, model, rank)
        if ep_degree(cfg) > 1:
            experts = expert_ids(model)
            dense = sum(p.numel() for p in model.parameters() if id(p) not in experts)
            micro = cfg.trainer.global_batch // (cfg.world_size * cfg.trainer.grad_accum)
            comm = {"all_reduce": 2.0 * 4 * dense, **balanced_comm(cfg, model, micro)}
        return add_comm(comm, context_comm(cfg, model, cfg.world_size // cp_of(cfg)))

    @classmethod
    def activation_bytes(
        cls, cfg: DictConfig, model: nn.Module, rank: int, micro: int, saved: SavedBytes
    ) -> tuple[int, int]:
        """With cp: what the cp-sharded vit or gpt saves on this rank (its tokens only; cp/rules.py);
        with ep: the rank's experts behind the exchanges (ep/rules.py expert_parallel_meta)."""
        if cp_of(cfg) < 2:
            model = expert_parallel_meta(model, cls.dims(cfg), rank)
            return super().activation_bytes(cfg, model, rank, micro, saved)
        return saved(context_meta(cfg, model, rank % cp_of(cfg)), micro, sample_shape(cfg.model), True), micro

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: nn.Module) -> ComputeShape:
        """With cp: a replica's micro-batch, each rank computing its T/cp tokens' share of the FLOPs
        (cp/rules.py context_flop_share)."""
        shape = super().compute_shape(cfg, model)
        if cp_of(cfg) < 2:
            return shape
        share = context_flop_share(cfg, model)
        return dataclasses.replace(shape, flop_share=share, note=f"cp rank does {share:.2f} of the FLOPs")

    @classmethod
    def overlapped_collectives(cls, cfg: DictConfig) -> frozenset[str]:
        """The reducer all-reduces each bucket from an autograd hook as soon as the bucket is full."""
        return frozenset({"all_reduce"})

    @classmethod
    def collective_calls(cls, cfg: DictConfig, model: nn.Module) -> dict[str, int]:
        """One all-reduce per bucket, the buckets as the reducer rebuilds them after the first step:
        gradients in the order backward makes them (about reverse registration), each bucket
        closed once it holds ``bucket_cap_mb`` (a tensor is never split). torch's 1 MiB first bucket
        is only for ``bucket_cap_mb=None``; ``setup`` always passes the option, so the first bucket
        is ``bucket_cap_mb`` too (torch 2.13, ``_BucketCapacityConfig``): the cnn's 1.3 MB of
        gradients are one bucket at 25 MiB, two at 0.25 MiB (fc1's 1 MB weight alone fills one)."""
        if cfg.world_size < 2:
            return {}
        experts = expert_ids(model)  # under ep, reduced outside DDP's buckets (strategies/ep/parallel.py)
        dense = [p.numel() for p in model.parameters() if ep_degree(cfg) == 1 or id(p) not in experts]
        return {"all_reduce": ddp_buckets([4 * n for n in dense], cfg.strategy.bucket_cap_mb)}

    @classmethod
    def reshard_refusal(cls, cfg: DictConfig) -> str | None:
        if ep_degree(cfg) > 1:  # strategies/ep/state.py: each rank's own file, experts not scattered
            return (
                f"trainer.reshard=true does not scatter experts under strategy.ep={ep_degree(cfg)}; use strategy.ep=1"
            )
        return super().reshard_refusal(cfg)

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        check_ep(cfg, MeshDims(replicate=cfg.world_size // max(1, cp_of(cfg)), ep=opts.ep))
        if opts.ep > 1 and cp_of(cfg) > 1:
            raise ConfigError(f"strategy.ep={opts.ep} with strategy.cp={cp_of(cfg)} is not composed; use one of them")
        if opts.bucket_cap_mb <= 0:
            raise ConfigError(
                f"strategy.bucket_cap_mb={opts.bucket_cap_mb} must be > 0; use e.g. strategy.bucket_cap_mb=25"
            )
        check_context(opts, cfg)


def ddp_buckets(grad_bytes: list[int], cap_mb: float) -> int:
    """Buckets of gradients of these sizes (registration order), filled in reverse, each closed at
    ``cap_mb`` MiB or more (torch's ``_compute_bucket_assignment_by_size``)."""
    cap, buckets, filled = cap_mb * 2**20, 0, 0
    for size in reversed(grad_bytes):
        filled += size
        if filled >= cap:
            buckets, filled = buckets + 1, 0
    return buckets + (filled > 0)
