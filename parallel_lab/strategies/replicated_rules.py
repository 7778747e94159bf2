"""The rules of the strategies whose every rank holds the whole model and optimizer state
(``ReplicatedPlan``; ``OneProcessPlan`` for one process), and of the two that run in one process:
``single`` (the baseline) and ``dp`` (torch DataParallel). Torch-free at import: the parent reads
them before any process starts (strategies/planning.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.choices import Precision
from parallel_lab.strategies.ep.rules import held_numels
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import PlanRules
from parallel_lab.strategies.registry import register_rules

if TYPE_CHECKING:
    from torch import nn


class ReplicatedPlan(PlanRules):
    """Every rank (or the one process) holds the whole model and all-reduces every gradient."""

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, int]:
        """Every parameter and gradient whole, fp32, and torch's optimizer state for each (Adam:
        two moments plus a 4-byte step tensor per parameter, which this measurement counts); under
        expert parallelism only this rank's experts (strategies/ep/)."""
        from parallel_lab.strategies.memory import predicted_optimizer_bytes

        numels = held_numels(cls.dims(cfg), model, rank)
        held = 4 * sum(numels)
        report = {
            "param_bytes": held,
            "grad_bytes": held,
            "optim_bytes": predicted_optimizer_bytes(numels, cfg.trainer, step_counters=True),
        }
        # DDP without gradient_as_bucket_view keeps its flat buckets beside the .grad tensors.
        if cfg.strategy.get("gradient_as_bucket_view") is False:
            report["comm_buffer_bytes"] = held
        return report

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, float]:
        """Data-parallel replicas all-reduce every gradient once per step (2 x its bytes, in the
        counter's units); one process sends nothing."""
        if cls.single_process or not cls.needs_process_group or cfg.world_size < 2:
            return {}
        from parallel_lab.strategies.memory import param_numels

        return {"all_reduce": 2.0 * 4 * sum(param_numels(model))}


class OneProcessPlan(ReplicatedPlan):
    """One process, no process group, no collectives (single, dp)."""

    single_process = True
    needs_process_group = False

    @classmethod
    def comm_theory_psi(cls, cfg: DictConfig) -> float:
        return 0.0


@dataclass
class SingleOptions(StrategyOptions):
    """``strategy=single`` options."""

    # fp32 | bf16: forward/backward on a bf16 copy of the fp32 weights (strategies/precision.py)
    precision: Precision = Precision.fp32


@register_rules("single")
class SinglePlan(OneProcessPlan):
    """The baseline: one process, the whole model; bf16 on per-forward copies of the weights."""

    Options = SingleOptions
    weight_copies = True


@register_rules("dp")
class DPPlan(OneProcessPlan):
    """DataParallel: one process driving every visible GPU; replicas exchange through device copies."""

    @classmethod
    def norm_refusal(cls, cfg: DictConfig) -> str | None:
        """DataParallel's replicas are threads of one process: no process group to synchronise
        over (torch's SyncBatchNorm works with DDP only)."""
        from parallel_lab.models import norm_of

        if norm_of(cfg.model) != "syncbatch":
            return None
        return (
            "model.norm=syncbatch: strategy=dp runs its replicas in one process, where SyncBatchNorm has no "
            "process group (torch supports it with DDP only); use strategy=ddp, or model.norm=batch"
        )
