"""``strategy.cp`` in the parent: its options (``ContextOptions``, mixed into a strategy's Options),
the refusals, and what the planner predicts of it: the bytes each implementation sends per step
and the meta copy of the cp-sharded model (vit or gpt) whose saved tensors are a rank's
activations. Torch-free at import (the parent refuses bad input before torch is imported)."""

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
    # (the gpt's model.seq; under the gpt's ring 2 x cp must: each rank holds two chunks)
    cp: int = 1
    # ring | ulysses (cp must divide model.heads, and the gpt's model.kv_heads) | deepspeed
    cp_impl: ContextImpl = ContextImpl.ring


def cp_of(cfg: DictConfig) -> int:
    return cfg.strategy.get("cp") or 1


def vit_tokens(cfg: DictConfig) -> int:
    from parallel_lab.models import IMAGE, vit_sizes

    return (IMAGE // vit_sizes(cfg.model)["patch"]) ** 2


def _check_vit(cp: int, impl: str, tp: int, cfg: DictConfig) -> dict:
    """The vit's tokens and heads under cp; returns its sizes."""
    from parallel_lab.models import vit_sizes

    sizes, tokens = vit_sizes(cfg.model), vit_tokens(cfg)
    if tokens % cp:
        raise ConfigError(
            f"strategy.cp={cp} does not divide the {tokens} tokens of model.patch={sizes['patch']}; "
            f"use a strategy.cp that divides {tokens} (or a model.patch whose (32/patch)^2 tokens it divides)"
        )
    if impl != "ring" and (sizes["heads"] // tp) % cp:
        held = f"the {sizes['heads'] // tp} heads of a tp rank" if tp > 1 else f"model.heads={sizes['heads']}"
        raise ConfigError(
            f"strategy.cp_impl={impl} gives each of the strategy.cp={cp} ranks whole heads of {held}; "
            f"use a strategy.cp that divides {sizes['heads'] // tp} or strategy.cp_impl=ring"
        )
    return sizes


def _check_gpt(cp: int, impl: str, tp: int, cfg: DictConfig) -> dict:
    """The gpt's sequence and heads under cp (the ring's two chunks, Ulysses' whole kv heads); its sizes."""
    from parallel_lab.models.gpt_sizes import gpt_sizes

    sizes = gpt_sizes(cfg.model)
    parts = 2 * cp if impl == "ring" else cp
    if sizes["seq"] % parts:
        why = f"2 x strategy.cp={cp} chunks (the load-balanced causal ring)" if impl == "ring" else f"strategy.cp={cp}"
        raise ConfigError(
            f"model.seq={sizes['seq']} does not split into {why}; use a model.seq that is a multiple of {parts}"
        )
    for key in ("heads", "kv_heads"):  # under strategy=tp: a tp rank's heads/tp (tp divides them, gpt_rules.py)
        held = sizes[key] // tp
        if impl != "ring" and held % cp:
            what = f"the {held} {key} of a tp rank" if tp > 1 else f"model.{key}={sizes[key]}"
            raise ConfigError(
                f"strategy.cp_impl={impl} gives each of the strategy.cp={cp} ranks whole heads of "
                f"{what}; use a strategy.cp that divides {held} or strategy.cp_impl=ring"
            )
    return sizes


def check_context(opts: DictConfig, cfg: DictConfig) -> None:
    """One line for every context-parallel configuration this project cannot run."""
    cp, impl = opts.cp, str(opts.cp_impl)
    if cp < 1:
        raise ConfigError(f"strategy.cp={cp} must be >= 1 (1 = no context parallelism); e.g. strategy.cp=2")
    if cp == 1:
        return
    if cfg.model.name not in ("vit", "gpt"):
        raise ConfigError(
            f"strategy.cp={cp} shards a transformer's tokens; model={cfg.model.name} has none: "
            "use model=vit or model=gpt"
        )
    tp = opts.get("tp") or 1
    sizes = (_check_gpt if cfg.model.name == "gpt" else _check_vit)(cp, impl, tp, cfg)
    experts = cfg.model.get("moe_experts") or 0
    if experts:
        raise ConfigError(
            f"model.moe_experts={experts} with strategy.cp={cp} is not built (a sample's routing group would "
            "be split over the cp ranks); use model.moe_experts=0 or strategy.cp=1"
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
    rank's tokens, Q = b*t*(h/tp)*4 one rank's queries and K = b*t*(kv width/tp)*4 its keys (or
    values; the vit's and a gpt without grouped-query attention: K = Q):

    - ring: per block and micro-batch, forward (cp-1) hops of K and V, backward (cp-1) of K and V
      and (cp-1) of dK and dV: ``isend`` 3*(cp-1)*2K (the gpt's causal ring sends whole blocks too);
    - ulysses / deepspeed: per block and micro-batch 4 all-to-alls forward (q, k, v to heads, the
      output back) and their 4 inverses backward: ``all_to_all_single`` 2*(2Q + 2K);
    - the vit's head pool: a forward all-reduce of (b, h) per micro-batch (counted twice its bytes);
      the gpt's head acts on each token alone and sends nothing."""
    if cp_of(cfg) < 2:
        return {}
    comm = attention_comm(cfg, _depth(cfg, model), data_parallel, tp)
    if cfg.model.name == "vit":
        comm["all_reduce"] = pool_comm(cfg, data_parallel)
    return comm


def pool_comm(cfg: DictConfig, data_parallel: int) -> float:
    """The vit's head pool: a forward all-reduce of (b, h) per micro-batch, counted twice its bytes."""
    accum = cfg.trainer.grad_accum
    return float(accum * 2 * (cfg.trainer.global_batch // accum // data_parallel) * attention_widths(cfg)[1] * 4)


def attention_comm(cfg: DictConfig, depth: int, data_parallel: int, tp: int = 1) -> dict[str, float]:
    """The attention's part of ``context_comm`` for ``depth`` blocks (a whole model, or one
    pipeline stage's: pp/cp_rules.py): the ring's ``isend`` or Ulysses' ``all_to_all_single``."""
    cp, accum = cp_of(cfg), cfg.trainer.grad_accum
    batch = cfg.trainer.global_batch // accum // data_parallel
    tokens, dim, kv_dim = attention_widths(cfg)
    q, k = (batch * (tokens // cp) * (width // tp) * 4 for width in (dim, kv_dim))
    if str(cfg.strategy.cp_impl) == "ring":
        return {"isend": float(accum * depth * 3 * (cp - 1) * 2 * k)}
    return {"all_to_all_single": float(accum * depth * 2 * (2 * q + 2 * k))}


def attention_widths(cfg: DictConfig) -> tuple[int, int, int]:
    """(tokens of a sample, query width, key/value width) of the vit or the gpt."""
    if cfg.model.name == "gpt":
        from parallel_lab.models.gpt_sizes import gpt_sizes

        s = gpt_sizes(cfg.model)
        return s["seq"], s["hidden"], s["kv_heads"] * (s["hidden"] // s["heads"])
    from parallel_lab.models import vit_sizes
    from parallel_lab.models.layout import vit_widths

    s = vit_sizes(cfg.model)  # the token width as model.width scales it (models/layout.py)
    dim = vit_widths(s["dim"], s["heads"], float(cfg.model.get("width", 1.0)), s["mlp_ratio"])[0]
    return vit_tokens(cfg), dim, dim


def _depth(cfg: DictConfig, model: nn.Module) -> int:
    """The model's attention blocks."""
    if cfg.model.name == "gpt":
        from parallel_lab.models.gpt_sizes import gpt_sizes

        return gpt_sizes(cfg.model)["layers"]
    from parallel_lab.strategies.cp.parallelize import blocks

    return len(blocks(model))


# The vit's layers that act on whole images or on the pooled vector, not on a rank's tokens: the
# patch convolution (its output is sliced after it, parallelize.py) and the classifier (after the
# pool's all-reduce). Every other counted layer acts on the rank's tokens.
WHOLE_ON_EVERY_CP_RANK = ("embed.proj", "head.fc")


def context_flop_share(cfg: DictConfig, model: nn.Module, tp_split: tuple[str, ...] = (), tp: int = 1) -> float:
    """A cp rank's share of the model's forward FLOPs (models/flops.py ``layer_flops``), for the
    step-time model's compute (planning.py ``ComputeShape.flop_share``): each Linear runs on the
    rank's T/cp tokens, and each attention core on its T/cp queries against all T keys (the ring:
    one block of T/cp keys per hop, cp hops; the gpt's causal zig-zag ring: 1/cp of the unmasked
    scores; Ulysses: heads/cp heads of whole sequences), so both are 1/cp of the whole model's;
    the vit's ``WHOLE_ON_EVERY_CP_RANK`` are not divided. ``tp_split`` (FSDP2 x TP): the layers a
    tp rank runs at 1/tp."""
    from parallel_lab.models.flops import layer_flops

    cp = cp_of(cfg)
    whole = WHOLE_ON_EVERY_CP_RANK if cfg.model.name == "vit" else ()
    flops = layer_flops(model, 1)
    mine = sum(f / (tp if name in tp_split else 1) / (1 if name in whole else cp) for name, f in flops.items())
    return mine / sum(flops.values())


def add_comm(comm: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Two predictions' bytes by collective, summed."""
    return {op: comm.get(op, 0.0) + more.get(op, 0.0) for op in {**comm, **more}}


def context_meta(cfg: DictConfig, model: nn.Module, cp_rank: int) -> nn.Module:
    """A meta copy of the vit or the gpt sharded as cp rank ``cp_rank`` shards it (its collectives
    only shape their outputs there; DeepSpeed's layer is counted as the hand-written Ulysses, which
    saves the same tensors): the planner counts what it saves."""
    from parallel_lab.strategies.cp.comm import CPGroup
    from parallel_lab.strategies.cp.parallelize import parallelize

    cp, impl = cp_of(cfg), str(cfg.strategy.cp_impl)
    copied = copy.deepcopy(model)
    parallelize(copied, CPGroup(None, cp_rank, cp), "ulysses" if impl == "deepspeed" else impl)
    return copied
