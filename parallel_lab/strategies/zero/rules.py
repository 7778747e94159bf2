"""ZeRO's parent-side rules (``ZeroPlan``): the stage each name stands for, the options DeepSpeed
accepts here, what the ZeRO paper's formula says, and what the planner predicts (``predict.py``)."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig

from parallel_lab.choices import Choice
from parallel_lab.errors import ConfigError
from parallel_lab.strategies.ep.rules import check_ep, ep_degree
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import ClusterLayout, ComputeShape, PlanRules, SavedBytes
from parallel_lab.strategies.registry import register_rules
from parallel_lab.strategies.zero.ds_config import DTYPE_BYTES, build_ds_config

if TYPE_CHECKING:
    import torch

STAGES = (0, 1, 2, 3)
ZERO = "zero"  # the names are zero<stage>


def _stage_from_name(name: str) -> int:
    return int(name[len(ZERO) :])


def zero_stage(name: str) -> int | None:
    """The ZeRO stage a strategy name stands for (``zero2`` -> 2), None for any other strategy."""
    return _stage_from_name(name) if name.startswith(ZERO) and name[len(ZERO) :].isdigit() else None


def zero_name(stage: int) -> str:
    """The strategy name of a ZeRO stage (2 -> ``zero2``)."""
    return f"{ZERO}{stage}"


def _cpu_only(cfg: DictConfig) -> bool:
    if cfg.device != "auto":
        return cfg.device == "cpu"
    import torch  # device=auto: whether it resolves to CUDA

    return not torch.cuda.is_available()


class Offload(Choice):
    """strategy.offload: where ZeRO keeps the optimizer state (stage 3: the parameters too)."""

    none = "none"
    cpu = "cpu"


class ZeroPrecision(Choice):
    """strategy.precision of zero0-3: DeepSpeed's modes (fp16 needs CUDA)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class ZeroOptions(StrategyOptions):
    """``strategy=zero0``..``zero3`` options. The stage is the name's digit."""

    # Filled in from the name (zero2 -> 2) when the config is validated; setting it is only a check.
    stage: Optional[int] = None
    # none | cpu: optimizer state + fp32 master partition on CPU (stage 3: parameters too); stages 1-3
    offload: Offload = Offload.none
    precision: ZeroPrecision = ZeroPrecision.fp32  # fp32 | bf16 (fp16 needs CUDA: refused on CPU)
    # reduce / all-gather bucket size in MiB (DeepSpeed's default, 500M elements, is 2 GB in fp32)
    bucket_mb: float = 25.0
    # a DeepSpeed JSON config of yours, taken unedited: what it sets is what the run does (batch,
    # clipping, optimizer, schedule, bf16, ZeRO keys); an explicit override contradicting it is refused
    ds_config: Optional[str] = None
    # Expert parallelism (docs/moe.md): stages 0-2 run DeepSpeed's own MoE layer (ds_moe.py),
    # experts sharded over ep data-parallel ranks; ZeRO-3 is refused, as DeepSpeed refuses it. 1 = none.
    ep: int = 1


@register_rules(*(f"zero{stage}" for stage in STAGES))
class ZeroPlan(PlanRules):
    Options = ZeroOptions
    syncs_batchnorm = True  # every rank reads its own samples

    @classmethod
    def reshard_refusal(cls, cfg: DictConfig) -> str | None:
        """16-bit ZeRO keeps an fp32 master beside 16-bit weights in layouts (FP16_UnfusedOptimizer at
        stage 0, BF16_Optimizer for a user's ds_config) this bridge does not fill. Under ep the
        experts live in DeepSpeed's layer (ds_moe.py), which the bridge does not scatter either."""
        if ep_degree(cfg) > 1:
            return (
                f"trainer.reshard=true does not scatter experts under strategy.ep={ep_degree(cfg)}; use strategy.ep=1"
            )
        if cfg.strategy.precision != "fp32" or cfg.strategy.ds_config:
            return (
                f"trainer.reshard=true into strategy={cfg.strategy.name} needs strategy.precision=fp32 and no "
                f"strategy.ds_config; reshard into fp32 first, or resume with the writing strategy"
            )
        return None

    @classmethod
    def cluster_layout(cls, cfg: DictConfig) -> ClusterLayout:
        """Every rank a data-parallel one; the stage shards the state over all of them (ZeRO, arXiv 1910.02054)."""
        layout = super().cluster_layout(cfg)
        stage = zero_stage(cfg.strategy.name) or 0
        ways = layout.dims.data_parallel_size if stage else 1
        return dataclasses.replace(layout, shard_stage=stage, shard_ways=ways, regathers_on_recompute=stage == 3)

    @classmethod
    def dims(cls, cfg: DictConfig) -> MeshDims:
        """Every rank a data-parallel one; under strategy.ep the experts over ep of them."""
        return MeshDims(replicate=cfg.world_size, ep=ep_degree(cfg))

    @classmethod
    def comm_theory_psi(cls, cfg: DictConfig) -> float | None:
        if ep_degree(cfg) > 1:  # the run's routing decides (strategy.py run_comm_theory_psi)
            return None
        # ZeRO paper section 7: stages 0-2 move 2Ψ per step (reduce-scatter + all-gather of the
        # gradients/parameters); stage 3 adds one more all-gather of the parameters for backward.
        # In bf16 DeepSpeed reduces and gathers bf16 tensors: half the bytes (measured: 1.5 / 1.03
        # at stages 1-2 / 3 for fp32's 3.0 / 2.05 on the cnn, docs/parity.md).
        return (3.0 if zero_stage(cfg.strategy.name) == 3 else 2.0) * DTYPE_BYTES[cfg.strategy.precision] / 4

    @classmethod
    def overlapped_collectives(cls, cfg: DictConfig) -> frozenset[str]:
        """Stage 3 sets overlap_comm and prefetches parameters; stages 0-2 here run with overlap_comm
        off (ds_config.py): nothing hidden."""
        if zero_stage(cfg.strategy.name) == 3:
            return frozenset({"all_gather", "reduce_scatter", "all_reduce"})
        return frozenset()

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: torch.nn.Module) -> ComputeShape:
        """Stage 3 fetches and releases each module's parameters from hooks around every pass: one
        hooked unit per module that owns parameters, and the root."""
        shape = super().compute_shape(cfg, model)
        if zero_stage(cfg.strategy.name) != 3:
            return shape
        owners = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
        return dataclasses.replace(shape, hooked_units=owners + 1)

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                f"strategy={opts.name} needs DeepSpeed, which is not installed; pip install deepspeed "
                f"(make installs it), or use strategy=fsdp for the same sharding in plain torch"
            )
        named = _stage_from_name(opts.name)
        if opts.ep != 1:
            check_zero_ep(opts, cfg, named)
        if opts.stage is None:
            opts.stage = named
        if opts.stage not in STAGES:
            raise ConfigError(
                f"strategy.stage={opts.stage} does not exist: ZeRO has stages 0-3; choose the stage by name "
                f"(strategy=zero0, zero1, zero2 or zero3) and drop strategy.stage"
            )
        if opts.stage != named:
            raise ConfigError(
                f"strategy.stage={opts.stage} contradicts strategy={opts.name} (stage {named}); "
                f"use strategy=zero{opts.stage} instead of overriding strategy.stage"
            )
        if opts.offload != "none" and opts.stage == 0:
            raise ConfigError(
                "strategy.offload=cpu needs a partitioned optimizer (ZeRO stage 1-3); "
                "use strategy=zero1, zero2 or zero3 with offload, or strategy.offload=none"
            )
        if opts.precision == "fp16" and _cpu_only(cfg):
            raise ConfigError(
                "strategy.precision=fp16 is not supported by DeepSpeed on CPU; use strategy.precision=bf16 or fp32 "
                "(fp16 needs device=cuda)"
            )
        if opts.bucket_mb <= 0:
            raise ConfigError(f"strategy.bucket_mb={opts.bucket_mb} must be > 0; use e.g. strategy.bucket_mb=25")
        ds_config = build_ds_config(cfg, opts)  # the file was read and adopted by validate() (zero/ds_file.py)
        if str(cfg.trainer.get("recompute", "none")) != "none":
            from parallel_lab.strategies.zero.ds_checkpointing import ds_checkpoint_refusal

            refusal = ds_checkpoint_refusal(ds_config)  # activation_checkpointing options it cannot honour here
            if refusal:
                raise ConfigError(refusal)

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int] | None:
        """DeepSpeed's flat buffers, padding and partition boundaries per stage (``predict.py``)."""
        from parallel_lab.strategies.zero.predict import predict_zero_memory

        return predict_zero_memory(cfg, model, rank)

    @classmethod
    def activation_bytes(
        cls, cfg: DictConfig, model: torch.nn.Module, rank: int, micro: int, saved: SavedBytes
    ) -> tuple[int, int]:
        """Under strategy.ep: what DeepSpeed's MoE layer saves in place of the model's, the rank's
        E / ep experts, every expert equally loaded (ds_moe_plan.py)."""
        if ep_degree(cfg) > 1:
            from parallel_lab.strategies.ep.groups import ep_rank
            from parallel_lab.strategies.zero.ds_moe_plan import deepspeed_moe_meta

            model = deepspeed_moe_meta(model, ep_degree(cfg), ep_rank(cls.dims(cfg), rank))
        return super().activation_bytes(cfg, model, rank, micro, saved)

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float] | None:
        from parallel_lab.strategies.zero.predict import predict_zero_comm

        return predict_zero_comm(cfg, model, rank)


def check_zero_ep(opts: DictConfig, cfg: DictConfig, stage: int) -> None:
    """strategy.ep under ZeRO: stages 0-2 with what DeepSpeed's MoE layer does as the model does
    (ds_moe.py): top-1 or top-2, dropless, no offload and no file of the user's (check_ep refuses
    bf16, which strategy.precision mirrors into trainer.precision)."""
    if stage == 3:
        raise ConfigError(
            f"strategy.ep={opts.ep} with strategy={opts.name}: DeepSpeed refuses MoE under ZeRO-3; "
            "use strategy=zero2 (or ddp, fsdp, tp) with strategy.ep, or strategy.ep=1"
        )
    check_ep(cfg, MeshDims(replicate=cfg.world_size, ep=opts.ep))
    model = cfg.model
    why = f"with strategy={opts.name} strategy.ep={opts.ep}"
    if (model.get("moe_topk") or 1) > 2:
        raise ConfigError(
            f"model.moe_topk={model.moe_topk} {why}: DeepSpeed's MoE layer gates top-1 or top-2 only; "
            "use model.moe_topk=1 or 2, or strategy=ddp with strategy.ep"
        )
    if model.get("moe_capacity_factor") is not None:
        raise ConfigError(
            f"model.moe_capacity_factor={model.moe_capacity_factor} {why}: DeepSpeed's layer renormalises the "
            "gates over the kept copies, the model does not; use model.moe_capacity_factor=null (dropless)"
        )
    for key, bad, fix in (
        ("offload", opts.offload != "none", "strategy.offload=none"),
        ("ds_config", bool(opts.ds_config), "no strategy.ds_config"),
    ):
        if bad:
            raise ConfigError(f"strategy.{key}={opts.get(key)} {why} is not wired; use {fix}")
