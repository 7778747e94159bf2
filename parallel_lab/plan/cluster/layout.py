"""From the composed config to a ``ClusterRun``: the strategy's own ``cluster_layout`` at
``plan.gpus`` GPUs, the degree left unset derived from it, and the planner's checks, each one line.

No world-size ceiling and no bf16 refusal: the cluster planner plans every strategy, tp and pp
included, in bf16 or fp16 (``plan.precision``) as Megatron trains them.
"""

from __future__ import annotations

import dataclasses
import pickle

from omegaconf import DictConfig, open_dict

from parallel_lab.errors import ConfigError
from parallel_lab.plan.cluster import context
from parallel_lab.plan.cluster.hardware import from_config
from parallel_lab.plan.cluster.shape import ModelShape, from_model_config
from parallel_lab.plan.cluster.steptime import ClusterRun
from parallel_lab.strategies import get_strategy_class
from parallel_lab.strategies.mesh import DIM_ORDER, TENSOR
from parallel_lab.strategies.planning import ClusterLayout


def _given(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").partition("=")[0] == key for o in overrides)


def _solve_degrees(cfg: DictConfig, rules: type, gpus: int, overrides: list[str]) -> None:
    """Make the strategy's degrees multiply to ``gpus``: strategy.replicate if not given, else its
    own degree (``degree_key``: pipeline stages, tp) if not given, else refuse in one line."""
    world = rules.dims(cfg).world
    if world == gpus:
        return
    for key in ("replicate", rules.degree_key):
        if key and key in cfg.strategy and not _given(overrides, f"strategy.{key}"):
            others = world // max(1, int(cfg.strategy[key]))
            if gpus % others == 0:
                cfg.strategy[key] = gpus // others
                if rules.dims(cfg).world == gpus:
                    return
    dims = rules.dims(cfg)
    raise ConfigError(
        f"strategy={cfg.strategy.name}'s degrees (replicate {dims.replicate} x shard {dims.shard} x cp {dims.cp} "
        f"x pp {dims.pp} x tp {dims.tp} = {dims.world}) do not multiply to plan.gpus={gpus}; change one of them "
        "or plan.gpus"
    )


def _check_cp(cfg: DictConfig, gpus: int, tp: int, pp: int) -> None:
    """strategy.cp times the layout's model-parallel degrees must divide the GPUs (the data-parallel
    degree is what is left), before the strategy derives its layout from them."""
    cp = int(cfg.strategy.get("cp") or 1)
    if cp < 1 or gpus % (cp * tp * pp):
        raise ConfigError(
            f"strategy.cp={cp} x strategy.tp={tp} x pp {pp} = {cp * tp * pp} does not divide plan.gpus={gpus} "
            f"(data-parallel ranks x cp x pp x tp = plan.gpus); use a strategy.cp that divides {gpus // (tp * pp)}"
        )


def _sharded_over_cp(rules: type, cfg: DictConfig, layout: ClusterLayout) -> ClusterLayout:
    """Under cp the strategy's sharding spans shard x cp (flattened, as torchtitan's dp_shard_cp):
    the cp ranks hold different tokens, not different parameters, so they shard the model state as
    the same world without cp would (which also keeps a stage at shard 1, cp 8)."""
    cp = layout.dims.cp
    if cp <= 1:
        return layout
    cfg.strategy.cp = 1  # cfg is cluster_run's own copy: the same world without cp, then back
    flat = rules.cluster_layout(cfg)
    cfg.strategy.cp = cp
    if flat.shard_stage == 0 or flat.shard_ways != layout.dims.shard * cp:
        return layout
    return dataclasses.replace(layout, shard_stage=flat.shard_stage, shard_ways=flat.shard_ways)


def _check(run: ClusterRun, cfg: DictConfig) -> None:
    shape, dims, lay = run.shape, run.layout.dims, run.layout
    chunks = dims.pp * (lay.virtual_stages if lay.schedule and "interleaved" in lay.schedule else 1)
    if shape.layers % chunks:
        raise ConfigError(
            f"{shape.layers} layers do not split into {chunks} pipeline chunks; "
            f"pick stages x virtual_stages dividing {shape.layers}"
        )
    if shape.heads % dims.tp or shape.kv_heads % dims.tp and dims.tp % shape.kv_heads:
        raise ConfigError(f"strategy tp degree {dims.tp} does not divide {shape.heads} heads; use a tp that divides it")
    context.check(shape, dims.cp, run.cp_impl, dims.tp)
    per_step = run.dp * lay.microbatches
    if run.global_batch % per_step:
        raise ConfigError(
            f"trainer.global_batch={run.global_batch} does not split into {run.dp} data-parallel ranks x "
            f"{lay.microbatches} micro-batches; use a multiple of {per_step}"
        )


def cluster_precision(cfg: DictConfig, overrides: list[str]) -> str:
    """plan.precision, else trainer.precision where the command sets it, else bf16 (GPU clusters
    train in mixed precision; the CPU runs' fp32 default is not the cluster's)."""
    if cfg.plan.get("precision"):
        return str(cfg.plan.precision)
    return str(cfg.trainer.precision) if _given(overrides, "trainer.precision") else "bf16"


def cluster_run(cfg: DictConfig, overrides: list[str]) -> ClusterRun:
    """The run ``cfg`` describes on ``plan.gpus`` GPUs of ``plan.hardware``."""
    rules = get_strategy_class(cfg.strategy.name).plan
    work = pickle.loads(pickle.dumps(cfg))
    gpus = int(cfg.plan.gpus or cfg.world_size)
    with open_dict(work):
        work.world_size = gpus
        _check_cp(work, gpus, int(work.strategy.get(TENSOR) or 1), 1)
        _solve_degrees(work, rules, gpus, overrides)
    layout = _sharded_over_cp(rules, work, rules.cluster_layout(work))
    precision = cluster_precision(cfg, overrides)
    run = ClusterRun(
        shape=from_model_config(cfg.model, bool(cfg.plan.get("fused_attention", False))),
        hw=from_config(cfg.plan.hardware),
        layout=layout,
        global_batch=int(cfg.trainer.global_batch),
        precision=precision,
        recompute=str(cfg.trainer.recompute),
        optimizer=str(cfg.trainer.optimizer),
        cp_impl=str(cfg.strategy.get("cp_impl") or "ring"),
    )
    _check(run, cfg)
    return run


def describe(run: ClusterRun) -> str:
    """'pp 8 x tp 8 x dp 16 (interleaved_1f1b, v=2, m=96, sp)' for the header."""
    dims, lay = run.layout.dims, run.layout
    parts = [f"{name} {getattr(dims, name)}" for name in DIM_ORDER if getattr(dims, name) > 1]
    extra = [f"ZeRO stage {lay.shard_stage} over {lay.shard_ways}"] if lay.shard_stage else []
    if lay.schedule and dims.pp > 1:
        extra.append(f"{lay.schedule}, v={lay.virtual_stages}, m={lay.microbatches}")
    if lay.sequence_parallel and dims.tp > 1:
        extra.append("sequence-parallel")
    if dims.cp > 1:
        extra.append(f"cp {run.cp_impl}")
    return " x ".join(parts or ["1 GPU"]) + (f" ({'; '.join(extra)})" if extra else "")


def shape_text(shape: ModelShape) -> str:
    return (
        f"{shape.name}: {shape.params() / 1e9:.1f}B parameters, {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.heads} heads ({shape.kv_heads} kv), seq {shape.seq}, vocab {shape.vocab}"
    )
