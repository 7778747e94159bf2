"""``strategy.cp`` in the parent: its options (``ContextOptions``, mixed into a strategy's Options),
the refusals, and what the planner predicts of it: the bytes each implementation sends per step
and the meta copy of the cp-sharded vit whose saved tensors are a rank's activations. Torch-free at
import (the parent refuses bad input before torch is imported)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.choices import Choice
from parallel_lab.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn


class ContextImpl(Choice):
    """strategy.cp_impl: how the attention sees every rank's tokens."""

    ring = "ring"  # hand-written ring attention: K/V blocks by send/recv, online softmax (cp/ring.py)
    ulysses = "ulysses"  # hand-written DeepSpeed-Ulysses: all-to-all tokens -> heads and back (cp/comm.py)
    deepspeed = "deepspeed"  # DeepSpeed's deepspeed.sequence.layer.DistributedAttention (Ulysses)


@dataclass
class ContextOptions:
    """The context-parallel options a strategy's Options take on (``strategy.cp``, ``strategy.cp_impl``)."""

    # context-parallel degree: each sample's tokens are split over cp ranks, which read the same
    # samples and average their gradients like data-parallel ranks; cp must divide the vit's tokens
    cp: int = 1
    cp_impl: ContextImpl = ContextImpl.ring  # ring | ulysses (cp must divide model.heads) | deepspeed


def cp_of(cfg: DictConfig) -> int:
    return cfg.strategy.get("cp") or 1


def vit_tokens(cfg: DictConfig) -> int:
    from parallel_lab.models import IMAGE, vit_sizes

    return (IMAGE // vit_sizes(cfg.model)["patch"]) ** 2


def check_context(opts: DictConfig, cfg: DictConfig) -> None:
    """One line for every context-parallel configuration this project cannot run."""
    cp, impl = opts.cp, str(opts.cp_impl)
    if cp < 1:
        raise ConfigError(f"strategy.cp={cp} must be >= 1 (1 = no context parallelism); e.g. strategy.cp=2")
    if cp == 1:
        return
    if cfg.model.name != "vit":
        what = "is not built on it (causal, load-balanced ring attention)" if cfg.model.name == "gpt" else "has none"
        raise ConfigError(f"strategy.cp={cp} shards the vit's tokens; model={cfg.model.name} {what}: use model=vit")
    from parallel_lab.models import vit_sizes

    sizes, tokens = vit_sizes(cfg.model), vit_tokens(cfg)
    if tokens % cp:
        raise ConfigError(
            f"strategy.cp={cp} does not divide the {tokens} tokens of model.patch={sizes['patch']}; "
            f"use a strategy.cp that divides {tokens} (or a model.patch whose (32/patch)^2 tokens it divides)"
        )
    tp = opts.get("tp") or 1
    if impl != "ring" and (sizes["heads"] // tp) % cp:
        held = f"the {sizes['heads'] // tp} heads of a tp rank" if tp > 1 else f"model.heads={sizes['heads']}"
        raise ConfigError(
            f"strategy.cp_impl={impl} gives each of the strategy.cp={cp} ranks whole heads of {held}; "
            f"use a strategy.cp that divides {sizes['heads'] // tp} or strategy.cp_impl=ring"
        )
    precision = opts.get("precision") or opts.get("mixed_precision") or "fp32"
    for key, value, fix in (
        ("model.dropout", sizes["dropout"], 0),
        ("trainer.recompute", str(cfg.trainer.recompute), "none"),
        ("strategy.precision", str(precision), "fp32"),
    ):
        if value != fix:
            raise ConfigError(
                f"{key}={value} with strategy.cp={cp} is not built (context parallelism runs fp32, without "
                f"dropout or recomputation); use {key}={fix}"
            )
    if cfg.world_size % cp:
        raise ConfigError(
            f"strategy.cp={cp} does not divide world_size={cfg.world_size} (data-parallel ranks x strategy.cp = "
            f"world_size); use world_size={cp * max(1, cfg.world_size // cp)} or a strategy.cp that divides it"
        )


def context_comm(cfg: DictConfig, model: nn.Module, data_parallel: int, tp: int = 1) -> dict[str, float]:
    """Bytes per step one cp rank sends for its attention and pool (comm/counter.py's units), with
    b the micro-batch (global batch / accumulation / ``data_parallel`` ranks), t = tokens/cp this
    rank's tokens, h/tp the width of its heads, A = b*t*(h/tp)*4 one rank's K (or V):

    - ring: per block and micro-batch, forward (cp-1) hops of K and V, backward (cp-1) of K and V
      and (cp-1) of dK and dV: ``isend`` 3*(cp-1)*2A;
    - ulysses / deepspeed: per block and micro-batch 4 all-to-alls forward (q, k, v to heads, the
      output back) and 4 backward, each of A: ``all_to_all_single`` 8A;
    - the head's pool: a forward all-reduce of (b, h) per micro-batch (counted twice its bytes)."""
    cp = cp_of(cfg)
    if cp < 2:
        return {}
    from parallel_lab.strategies.cp.parallelize import blocks

    accum, depth, dim = cfg.trainer.grad_accum, len(blocks(model)), model.embed.pos.shape[-1]
    batch = cfg.trainer.global_batch // accum // data_parallel
    a = batch * (vit_tokens(cfg) // cp) * (dim // tp) * 4
    if str(cfg.strategy.cp_impl) == "ring":
        comm = {"isend": float(accum * depth * 3 * (cp - 1) * 2 * a)}
    else:
        comm = {"all_to_all_single": float(accum * depth * 8 * a)}
    comm["all_reduce"] = float(accum * 2 * batch * dim * 4)
    return comm


def add_comm(comm: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Two predictions' bytes by collective, summed."""
    return {op: comm.get(op, 0.0) + more.get(op, 0.0) for op in {**comm, **more}}


def context_meta_vit(cfg: DictConfig, model: nn.Module, cp_rank: int) -> nn.Module:
    """A meta copy of the vit sharded as cp rank ``cp_rank`` shards it (its collectives only shape
    their outputs there; DeepSpeed's layer is counted as the hand-written Ulysses, which saves the
    same tensors): the planner counts what it saves."""
    from parallel_lab.strategies.cp.comm import CPGroup
    from parallel_lab.strategies.cp.parallelize import parallelize_vit

    cp, impl = cp_of(cfg), str(cfg.strategy.cp_impl)
    return parallelize_vit(copy.deepcopy(model), CPGroup(None, cp_rank, cp), "ulysses" if impl == "deepspeed" else impl)
