"""``pp``'s parent-side rules (``PPPlan``): the options it refuses, the (replicate, pp) mesh it lays
out, and what the planner predicts of each stage (the cut is ``plan.py``'s, the same setup makes)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from omegaconf import DictConfig
from torch import nn

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.memory import predicted_optimizer_bytes
from parallel_lab.strategies.mesh import MeshDims, check_degrees
from parallel_lab.strategies.planning import SAMPLE_SHAPE, ComputeShape, PlanRules, SavedBytes
from parallel_lab.strategies.pp.plan import plan_stages, stage_shares


def meta_model(cfg: DictConfig) -> nn.Sequential:
    """The model's structure without weights (meta device): for planning and shape inference."""
    from parallel_lab.models import build_meta_model

    return build_meta_model(cfg.model)


def _stage_module(cfg: DictConfig, model: nn.Sequential, rank: int) -> nn.Sequential:
    """Stage ``rank % stages`` of the (meta) model, as setup cuts it."""
    names = plan_stages(model, cfg.strategy.stages, list(cfg.strategy.cuts))[rank % cfg.strategy.stages]
    return nn.Sequential(OrderedDict((n, model.get_submodule(n)) for n in names))


def pp_dims(opts: DictConfig) -> MeshDims:
    """strategy.replicate pipelines of strategy.stages consecutive ranks; the pipeline's group is
    laid out even at one stage (its sends stay inside it)."""
    return MeshDims(replicate=opts.replicate, pp=opts.stages, named=("pp",))


class PPPlan(PlanRules):
    degree_key = "stages"
    ranks_differ = True  # each stage holds, stashes and sends its own part

    @classmethod
    def dims(cls, cfg: DictConfig) -> MeshDims:
        return pp_dims(cfg.strategy)

    @classmethod
    def data_parallel_size(cls, cfg: DictConfig) -> int:
        """Every stage sees its pipeline's whole batch, only the ends use it (= strategy.replicate
        once the degrees check; the planner asks before setting them)."""
        return cfg.world_size // cfg.strategy.stages

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        for key in ("stages", "microbatches"):
            if opts[key] < 1:
                raise ConfigError(f"strategy.{key}={opts[key]} must be >= 1; e.g. strategy.{key}=2")
        plan_stages(meta_model(cfg), opts.stages, list(opts.cuts))
        check_degrees(cfg, pp_dims(opts), {"pp": ("stages", "pipeline stages, one per process")})
        t = cfg.trainer
        per_step = t.global_batch // t.grad_accum
        if t.global_batch % t.grad_accum == 0 and per_step % opts.microbatches:
            raise ConfigError(
                f"strategy.microbatches={opts.microbatches} does not divide the per-step micro-batch of {per_step} "
                f"samples (trainer.global_batch={t.global_batch} / trainer.grad_accum={t.grad_accum}); "
                f"use a divisor of {per_step}"
            )
        if opts.impl == "deepspeed":
            from parallel_lab.strategies.pp.ds_rules import check_deepspeed_pipe

            check_deepspeed_pipe(opts, cfg)
        if opts.impl == "torch" and opts.schedule == "1f1b" and opts.microbatches < opts.stages:
            raise ConfigError(
                f"strategy.microbatches={opts.microbatches} < strategy.stages={opts.stages}: torch's Schedule1F1B "
                f"needs microbatches >= stages; raise strategy.microbatches or use strategy.impl=manual"
            )

    @classmethod
    def min_global_batch(cls, cfg: DictConfig) -> int:
        return cfg.strategy.microbatches * cfg.trainer.grad_accum

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: nn.Module) -> ComputeShape:
        """GPipe (1811.06965): m forward and m backward slots per stage, p - 1 of them idle at the
        ends; the slowest stage paces every slot (1f1b has the same count of slots, fewer in flight)."""
        p, m, t = cfg.strategy.stages, cfg.strategy.microbatches, cfg.trainer
        shares = stage_shares([_stage_module(cfg, model, s) for s in range(p)])
        return ComputeShape(
            micro_batch=t.global_batch // t.grad_accum // m,
            slots=t.grad_accum * (m + p - 1),
            flop_share=max(shares),
            calls_per_collective=m * t.grad_accum,
            note=f"stage FLOP shares {', '.join(f'{s:.2f}' for s in shares)}",
        )

    @classmethod
    def activation_bytes(
        cls, cfg: DictConfig, model: nn.Module, rank: int, micro: int, saved: SavedBytes
    ) -> tuple[int, int]:
        """Stages stash micro-batches (gpipe: all m; 1f1b: at most p - s); only the last stage
        computes the loss."""
        p, m, stage = cfg.strategy.stages, cfg.strategy.microbatches, rank % cfg.strategy.stages
        mb = max(1, micro // m)
        x = torch.empty(mb, *SAMPLE_SHAPE, device="meta")
        with torch.no_grad():
            for s in range(stage):
                x = _stage_module(cfg, model, s)(x)
        stash = m if cfg.strategy.schedule == "gpipe" else min(m, p - stage)
        last = stage == p - 1
        return stash * saved(_stage_module(cfg, model, stage), mb, tuple(x.shape[1:]), last), mb

    @classmethod
    def predict_buffer_bytes(cls, cfg: DictConfig, model: nn.Module, rank: int) -> int:
        """The stage's BatchNorm buffers only."""
        return sum(b.numel() * b.element_size() for b in _stage_module(cfg, model, rank).buffers())

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, int]:
        """The stage's blocks (``plan_stages``, the same cut setup makes), held whole with torch's
        optimizer state (Adam: two moments and a 4-byte step tensor per parameter)."""
        numels = [p.numel() for p in _stage_module(cfg, model, rank).parameters()]
        return {
            "param_bytes": 4 * sum(numels),
            "grad_bytes": 4 * sum(numels),
            "optim_bytes": predicted_optimizer_bytes(numels, cfg.trainer, step_counters=True),
        }

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, float]:
        """Per step, every micro-batch's activation goes forward across each boundary after this
        stage and its gradient back across the one before it: isend of the whole step's batch."""
        p, stage = cfg.strategy.stages, rank % cfg.strategy.stages
        batch = cfg.trainer.global_batch // cfg.trainer.grad_accum // (cfg.strategy.get("replicate") or 1)
        x = torch.empty(batch, 3, 32, 32, device="meta")
        boundaries = []
        with torch.no_grad():
            for s in range(p):
                boundaries.append(x.numel())  # this stage's input
                x = _stage_module(cfg, model, s)(x)
        sent = (boundaries[stage + 1] if stage < p - 1 else 0) + (boundaries[stage] if stage > 0 else 0)
        comm = {"isend": 4.0 * sent * cfg.trainer.grad_accum} if sent else {}
        if (cfg.strategy.get("replicate") or 1) > 1:  # dp x pp: the stage's gradients all-reduced over replicas
            comm["all_reduce"] = 2.0 * 4 * sum(q.numel() for q in _stage_module(cfg, model, rank).parameters())
        return comm
