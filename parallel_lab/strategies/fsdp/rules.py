"""``fsdp``'s options (``FSDPOptions``) and parent-side rules (``FSDPPlan``): its options (hybrid
needs FSDP2 and a replicate degree), the mesh it lays out (HSDP: replicate x shard), what the ZeRO
paper's formula says and what the planner predicts (``predict.py``). Torch-free at import: the
parent reads it before any process starts (strategies/planning.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig

from parallel_lab.choices import Choice, Precision
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
from parallel_lab.strategies.ep.rules import check_ep, ep_degree, expert_parallel_meta
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import ClusterLayout, ComputeShape, PlanRules, SavedBytes
from parallel_lab.strategies.registry import register_rules

if TYPE_CHECKING:
    import torch


def shard_size(cfg: DictConfig) -> int:
    """Ranks one copy of the model is sharded over: the world, or a shard group (hybrid)."""
    if cfg.strategy.sharding == "hybrid":
        return cfg.world_size // cfg.strategy.replicate
    return cfg.world_size


def fsdp_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """FSDP units: the model's top-level blocks that own parameters (the root wraps the rest). Blocks
    that share a weight (the model's ``tied_children``: gpt's embedding and the head that projects
    with its weight) stay in the root, whose parameters stay gathered from forward to backward: a
    unit would free the weight while the other block still needs it."""
    tied = set(getattr(model, "tied_children", ()))
    return [
        (name, child)
        for name, child in model.named_children()
        if name not in tied and any(True for _ in child.parameters())
    ]


def check_hybrid_cp(opts: DictConfig, world: int) -> None:
    """HSDP x CP: replicas x shard x cp = world_size, so replicate x cp must divide it (the shard
    degree is what is left; fully_shard shards over shard x cp, as torchtitan flattens them)."""
    replicate, cp = opts.replicate, opts.cp
    if world % (replicate * cp):
        raise ConfigError(
            f"strategy.replicate={replicate} x strategy.cp={cp} does not divide world_size={world} "
            f"(replicas x shard x cp = world_size); use a strategy.replicate that divides world_size / "
            f"strategy.cp = {world // cp}, or world_size={replicate * cp}"
        )


SHARD_STAGE = {"full": 3, "hybrid": 3, "grad_op": 2, "no_shard": 0}  # strategy.sharding -> the ZeRO stage it resembles


class Sharding(Choice):
    """strategy.sharding: what FSDP shards across the ranks (FSDPOptions.sharding)."""

    full = "full"
    grad_op = "grad_op"
    no_shard = "no_shard"
    hybrid = "hybrid"


@dataclass
class FSDPOptions(ContextOptions, StrategyOptions):
    """``strategy=fsdp`` options (with ``strategy.cp``/``cp_impl``: context parallelism, strategies/cp:
    fully_shard then shards over the shard x cp ranks, as torchtitan does)."""

    version: int = 2  # 2: fully_shard (per-parameter DTensor shards); 1: FullyShardedDataParallel wrapper
    # full = FULL_SHARD ~ ZeRO-3 | grad_op = SHARD_GRAD_OP ~ ZeRO-2 | no_shard = NO_SHARD ~ DDP
    # (FSDP2: full/grad_op = reshard_after_forward True/False; no_shard = a replicate N x shard 1 mesh)
    # | hybrid = HSDP, FSDP2 on a replicate x shard mesh: full shard within a group, replicas across.
    sharding: Sharding = Sharding.full
    # hybrid only: data-parallel replicas R (the mesh's replicate dimension, e.g. one per host);
    # R x shard group size = world_size. null = not given: hybrid is refused without it.
    replicate: Optional[int] = None
    # fp32 | bf16 (bf16 compute and all-gathers; fp32 shards, Adam state, reductions)
    mixed_precision: Precision = Precision.fp32
    # 2-D FSDP2 x TP (torchtitan's; model=vit, version 2, sharding=full, fp32): each run of tp
    # consecutive ranks splits the vit's blocks (Megatron, tp/split.py with DTensor) and fully_shard
    # shards over the world_size/tp data-parallel ranks of the same (shard, tp) mesh. 1 = no TP.
    tp: int = 1
    # Expert parallelism (model.moe_experts > 0, FSDP2 full or hybrid sharding): each rank holds its
    # moe_experts / ep experts whole, outside fully_shard (strategies/ep/, docs/moe.md). 1 = none.
    ep: int = 1


@register_rules("fsdp")
class FSDPPlan(PlanRules):
    Options = FSDPOptions
    syncs_batchnorm = True  # every rank reads its own samples, shard and replicate dimensions alike

    @classmethod
    def cluster_layout(cls, cfg: DictConfig) -> ClusterLayout:
        """Sharded over the shard dim (hybrid: replicated across strategy.replicate); FSDP2 x TP
        shards over the ranks of one tp coordinate."""
        layout = super().cluster_layout(cfg)
        stage = SHARD_STAGE[str(cfg.strategy.sharding)]
        ways = layout.dims.shard if stage else 1
        return dataclasses.replace(layout, shard_stage=stage if ways > 1 else 0, shard_ways=ways)

    @classmethod
    def dims(cls, cfg: DictConfig) -> MeshDims:
        """hybrid: a replicate x shard mesh (both laid out, whatever their sizes: FSDP2 needs the
        2-D mesh); no_shard: replicas; full and grad_op: one shard group of the whole world."""
        opts = cfg.strategy
        cp = cp_of(cfg)
        if cp > 1:
            return cls._dims_cp(cfg, cp)
        if opts.get("tp", 1) > 1:  # 2-D FSDP2 x TP: fully_shard over shard, Megatron over tp; ep over shard
            return MeshDims(shard=cfg.world_size // opts.tp, tp=opts.tp, ep=ep_degree(cfg), named=("shard", "tp"))
        if opts.sharding == "hybrid":  # ep: experts over ep ranks of each shard group (ep/groups.py)
            dims = MeshDims(replicate=opts.replicate, shard=shard_size(cfg), named=("replicate", "shard"))
            return dataclasses.replace(dims, ep=ep_degree(cfg))
        if opts.sharding == "no_shard":
            return MeshDims(replicate=cfg.world_size)
        return MeshDims(shard=cfg.world_size, ep=ep_degree(cfg))

    @classmethod
    def _dims_cp(cls, cfg: DictConfig, cp: int) -> MeshDims:
        """fully_shard over shard x cp (flattened, torchtitan's dp_shard x cp), the cp ranks' attention
        over cp, Megatron over tp; hybrid (HSDP x CP): replicas of that outside, replicate x shard x cp."""
        opts = cfg.strategy
        tp, replicate = opts.get("tp", 1), (opts.get("replicate") or 1) if opts.sharding == "hybrid" else 1
        named = ("replicate",) * (opts.sharding == "hybrid") + ("shard", "cp", "tp")
        shard = cfg.world_size // (replicate * cp * tp)
        return MeshDims(replicate=replicate, shard=shard, cp=cp, tp=tp, named=named)

    @classmethod
    def overlapped_collectives(cls, cfg: DictConfig) -> frozenset[str]:
        """FSDP2 prefetches the next unit's all-gather and reduce-scatters each unit from its hook."""
        return frozenset({"all_gather", "reduce_scatter"})

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: torch.nn.Module) -> ComputeShape:
        """The data-parallel shape, plus each unit's hooks (every block, then the root) around every
        pass; FSDP2's parameters are DTensors, which the optimizer steps one dispatch at a time."""
        shape = super().compute_shape(cfg, model)
        units = len(fsdp_units(model)) + 1
        shape = dataclasses.replace(shape, hooked_units=units, dtensor_optimizer=cfg.strategy.version == 2)
        tp, cp = cfg.strategy.get("tp", 1), cp_of(cfg)
        if tp == 1 and cp == 1:
            return shape
        from parallel_lab.strategies.tp.megatron import blocks, vit_plan

        # FSDP2 x TP: a tp rank runs the split layers (and its heads' attention core) at 1/tp;
        # x CP: on its T/cp tokens (cp/rules.py context_flop_share)
        split = [layer for pair in vit_plan(model) for layer in pair if layer] if tp > 1 else []
        split += [f"{b}.attn.core" for b in blocks(model)] if tp > 1 else []
        share = context_flop_share(cfg, model, tuple(split), tp)
        return dataclasses.replace(shape, flop_share=share, note=f"a rank does {share:.2f} of the FLOPs")

    @classmethod
    def collective_calls(cls, cfg: DictConfig, model: torch.nn.Module) -> dict[str, int]:
        """One all-gather per unit (each block, then the root) in forward and again in backward
        when it reshards after forward; one reduce-scatter per unit (HSDP: and one all-reduce)."""
        units, accum = len(fsdp_units(model)) + 1, cfg.trainer.grad_accum  # each micro-batch's passes
        gathers = accum * (2 if cfg.strategy.sharding != "grad_op" else 1)
        calls = {"all_gather_into_tensor": units * gathers, "all_gather_single": units * gathers,
                 "reduce_scatter_tensor": units * accum, "reduce_scatter_single": units * accum}  # fmt: skip
        if cfg.strategy.sharding == "hybrid":  # HSDP: each unit's reduced shard all-reduced over replicate
            calls["all_reduce"] = units * accum
        if cfg.strategy.get("tp", 1) > 1:  # FSDP2 x TP: Megatron's 2 all-reduces a block each way
            from parallel_lab.strategies.tp.megatron import blocks, dense_mlp

            split = sum(1 + dense_mlp(model, b) for b in blocks(model))  # an MoE block: its attention's
            calls["all_reduce"] = 2 * split * cfg.trainer.grad_accum
        return calls

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if opts.version not in (1, 2):
            raise ConfigError(
                f"strategy.version={opts.version} is unknown; use strategy.version=2 (fully_shard) or 1 (FSDP1 wrapper)"
            )
        cls._check_hybrid(opts, cfg)
        if opts.tp != 1:
            cls._check_tp(opts, cfg)
        if opts.ep != 1:
            cls._check_ep(opts, cfg)
        if opts.cp != 1:
            cls._check_cp(opts, cfg)

    @classmethod
    def _check_ep(cls, opts: DictConfig, cfg: DictConfig) -> None:
        """Expert parallelism under FSDP2 full sharding (shard x ep) or HSDP (replicate x shard x ep).
        Under hybrid, as torchtitan lays it out, ep borrows its ranks from the shard dimension:
        an ep group is ep consecutive ranks of one shard group (inside a host), the ranks holding
        the same experts span the replicas and the rest of the shard group (ep/groups.py)."""
        if opts.version != 2 or opts.sharding not in ("full", "hybrid") or (opts.tp != 1 and opts.sharding != "full"):
            raise ConfigError(
                f"strategy.ep={opts.ep} runs with FSDP2 full or hybrid sharding (strategy.version=2 "
                f"strategy.sharding=full|hybrid, strategy.tp only with full), not version={opts.version} "
                f"sharding={opts.sharding} tp={opts.tp}; use those, or strategy.ep=1"
            )
        if opts.sharding == "hybrid" and opts.ep > 0 and shard_size(cfg) % opts.ep:
            raise ConfigError(
                f"strategy.ep={opts.ep} does not divide the shard group size {shard_size(cfg)} "
                f"(world_size={cfg.world_size} / strategy.replicate={opts.replicate}; under hybrid ep spans "
                f"the ranks of one shard group); use an ep that divides {shard_size(cfg)} or a smaller "
                "strategy.replicate"
            )
        check_ep(cfg, cls.dims(cfg))

    @classmethod
    def _check_cp(cls, opts: DictConfig, cfg: DictConfig) -> None:
        """Context parallelism under FSDP2's full or grad_op sharding over shard x cp, or hybrid's
        (HSDP) over replicate x (shard x cp)."""
        for key, got, want in (("strategy.version", opts.version, 2), ("strategy.sharding", opts.sharding, "full")):
            if got != want and not (key == "strategy.sharding" and got in ("grad_op", "hybrid")):
                raise ConfigError(
                    f"strategy.cp={opts.cp} needs {key}={want} (fully_shard over shard x cp), got {key}={got}; "
                    f"set {key}={want} (or grad_op, hybrid) or strategy.cp=1"
                )
        if opts.ep != 1:
            raise ConfigError(f"strategy.ep={opts.ep} with strategy.cp={opts.cp} is not built; use one of them")
        check_context(opts, cfg)
        if opts.sharding == "hybrid":
            return check_hybrid_cp(opts, cfg.world_size)
        if cfg.world_size % (opts.cp * opts.tp):
            raise ConfigError(
                f"strategy.cp={opts.cp} x strategy.tp={opts.tp} does not divide world_size={cfg.world_size} "
                f"(shard x cp x tp = world_size); use world_size={opts.cp * opts.tp}"
            )

    @classmethod
    def _check_tp(cls, opts: DictConfig, cfg: DictConfig) -> None:
        """2-D FSDP2 x TP: the vit's Megatron split (its own rules, tp/rules.py) under full sharding."""
        from parallel_lab.strategies.tp.rules import check_vit_split

        if opts.tp < 1 or cfg.world_size % opts.tp:
            raise ConfigError(
                f"strategy.tp={opts.tp} must be >= 1 and divide world_size={cfg.world_size}; e.g. strategy.tp=2"
            )
        if cfg.model.name == "gpt" and opts.cp == 1:  # built with cp only (tests/integration/test_cp_vit.py)
            raise ConfigError(
                f"strategy=fsdp strategy.tp={opts.tp} (2-D FSDP2 x TP) runs model=gpt with strategy.cp > 1 only; "
                f"use strategy=tp strategy.tp={opts.tp} (the gpt's vocab-parallel split), or add strategy.cp=2"
            )
        wanted = {
            "model": (cfg.model.name, cfg.model.name if cfg.model.name == "gpt" else "vit"),
            "strategy.version": (opts.version, 2),
            "strategy.sharding": (opts.sharding, "full"),
            "strategy.mixed_precision": (opts.mixed_precision, "fp32"),
        }
        for key, (got, want) in wanted.items():
            if got != want:
                raise ConfigError(
                    f"strategy.tp={opts.tp} (2-D FSDP2 x TP) needs {key}={want}, got {key}={got}; "
                    f"set {key}={want} or strategy.tp=1"
                )
        if cfg.model.name == "gpt":  # FSDP2 over shard x cp on top of the manual vocab-parallel split
            from omegaconf import OmegaConf

            from parallel_lab.strategies.tp.gpt_rules import check_gpt_split

            return check_gpt_split(cfg, OmegaConf.create({"impl": "manual", "tp": opts.tp, "sequence_parallel": False}))
        check_vit_split(cfg, opts.tp, sequence_parallel=False, impl="dtensor")

    @classmethod
    def _check_hybrid(cls, opts: DictConfig, cfg: DictConfig) -> None:
        """hybrid needs FSDP2 and the replicate degree of its mesh; replicate means nothing elsewhere."""
        if opts.sharding != "hybrid":
            if opts.replicate is not None:
                raise ConfigError(
                    f"strategy.replicate={opts.replicate} applies to strategy.sharding=hybrid only; "
                    f"add strategy.sharding=hybrid or drop strategy.replicate"
                )
            return
        if opts.version != 2:
            raise ConfigError(
                "strategy.sharding=hybrid needs strategy.version=2 (fully_shard on a 2-D mesh); "
                "FSDP1's HYBRID_SHARD diverges on one node, see docs/facts.md"
            )
        world = cfg.world_size
        example = next((r for r in range(2, world) if world % r == 0), None)
        hint = (
            f"e.g. strategy.replicate={example} ({example} x {world // example} = world_size={world})"
            if example
            else f"e.g. world_size=4 strategy.replicate=2 (world_size={world} has no split into replicas x shards)"
        )
        if opts.replicate is None:
            raise ConfigError(
                "strategy.sharding=hybrid needs the replicate degree of its replicate x shard mesh "
                f"(replicas x shard group size = world_size); set strategy.replicate=<replicas>, {hint}"
            )
        if opts.replicate < 1 or world % opts.replicate:
            raise ConfigError(
                f"strategy.replicate={opts.replicate} does not divide world_size={world} "
                f"(replicas x shard group size = world_size); {hint}"
            )

    @classmethod
    def comm_theory_psi(cls, cfg: DictConfig) -> float | None:
        # full: all-gather for forward and again for backward, reduce-scatter of grads = 3Ψ;
        # grad_op keeps the forward gather for backward (2Ψ); no_shard all-reduces grads (2Ψ);
        # hybrid: full inside a shard group (3Ψ) + all-reduce of the Ψ/S gradient shard across (2Ψ/S).
        # bf16 (MixedPrecisionPolicy): each all-gather moves bf16, half of Ψ; the reductions stay fp32.
        if cp_of(cfg) > 1 or cfg.strategy.get("tp", 1) > 1:
            return None  # the attention's (Megatron's) bytes are no multiple of Ψ: the report takes predict_comm's
        gather = 0.5 if cfg.strategy.mixed_precision == "bf16" else 1.0
        if ep_degree(cfg) > 1:
            return None  # the run's routing decides (fsdp/strategy.py run_comm_theory_psi)
        # per micro-batch: each one's backward reduces (fsdp/strategy.py has no no_sync)
        if cfg.strategy.sharding == "hybrid":
            return cfg.trainer.grad_accum * (2 * gather + 1.0 + 2.0 / shard_size(cfg))
        per_micro = {"full": 2 * gather + 1.0, "grad_op": gather + 1.0}.get(cfg.strategy.sharding, 2.0)
        return cfg.trainer.grad_accum * per_micro

    @classmethod
    def activation_bytes(
        cls, cfg: DictConfig, model: torch.nn.Module, rank: int, micro: int, saved: SavedBytes
    ) -> tuple[int, int]:
        """strategy.tp > 1: what the rank's Megatron-split vit saves (tp/predict.py; the real 2-D
        forward saves the same, tests/integration/test_cp_vit.py); otherwise the whole model's, under
        ep with the rank's experts behind the exchanges (ep/rules.py expert_parallel_meta)."""
        tp, cp = cfg.strategy.get("tp", 1), cp_of(cfg)
        if tp == 1 and cp == 1:
            model = expert_parallel_meta(model, cls.dims(cfg), rank)
            return super().activation_bytes(cfg, model, rank, micro, saved)
        if tp > 1 and cfg.model.name == "gpt":  # the manual split, cp-sharded, with its vocab-parallel loss
            from parallel_lab.models import input_shape
            from parallel_lab.strategies.tp.gpt_predict import split_meta_gpt

            return saved(split_meta_gpt(cfg, model, rank), micro, input_shape(model), False), micro
        if tp > 1:  # under ep an MoE block's MLP stays whole, the rank's experts behind the exchanges
            from parallel_lab.strategies.tp.predict import split_meta_vit

            model = expert_parallel_meta(split_meta_vit(cfg, model, rank), cls.dims(cfg), rank)
        if cp > 1:  # the cp-sharded vit (cp/rules.py), on the tp split's heads
            model = context_meta(cfg, model, cls.dims(cfg).coords(rank)["cp"])
        return saved(model, micro, sample_shape(cfg.model), True), micro

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int] | None:
        """FSDP2's per-parameter dim-0 shards with padding (``predict.py``; under FSDP2 x TP of
        each tp-local shard); FSDP1's flat parameters are not predicted."""
        from parallel_lab.strategies.fsdp.predict import predict_fsdp2_memory

        return predict_fsdp2_memory(cfg, model, rank) if cfg.strategy.version == 2 else None

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, float] | None:
        """FSDP2's gathers and reductions (``predict.py``; under FSDP2 x TP over the tp-local
        shards, plus Megatron's all-reduces), plus context parallelism's attention on the tp
        rank's heads (cp/rules.py)."""
        from parallel_lab.strategies.fsdp.predict import predict_fsdp2_comm

        if cfg.strategy.version != 2:
            return None
        comm = predict_fsdp2_comm(cfg, model, rank)
        if comm is None:  # HSDP: not predicted
            return None
        dims = cls.dims(cfg)
        return add_comm(comm, context_comm(cfg, model, dims.data_parallel_size, dims.tp))
