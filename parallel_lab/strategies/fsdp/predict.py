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
full gradients once; ``no_shard`` all-reduces the gradients over the replicate dimension instead;
HSDP x CP (``hybrid`` with ``strategy.cp``) is ``full`` over the shard x cp ranks plus an
all-reduce of each reduced padded shard over the replicate dimension.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from parallel_lab.strategies.ep.rules import balanced_comm, ep_degree, expert_ids, local_expert_numels
from parallel_lab.strategies.memory import chunk_rows, predicted_optimizer_bytes
from parallel_lab.strategies.mesh import MeshDims


def _shard_world(cfg: DictConfig) -> int:
    """Ranks one parameter is sharded over: all, one (no_shard), a shard group (hybrid = HSDP; with
    cp its shard x cp ranks), or the world / tp ranks of one tp coordinate (FSDP2 x TP, shard x cp flattened)."""
    if cfg.strategy.sharding == "no_shard":
        return 1
    if cfg.strategy.sharding == "hybrid":
        return cfg.world_size // (cfg.strategy.get("replicate") or 1)
    return cfg.world_size // _tp(cfg)


def _tp(cfg: DictConfig) -> int:
    return cfg.strategy.get("tp") or 1


def _sharded(cfg: DictConfig, model: torch.nn.Module, rank: int) -> tuple[torch.nn.Module, int, int]:
    """(the model whose parameters fully_shard shards on ``rank``: the tp-local split under FSDP2 x
    TP, the ranks it shards them over, ``rank``'s place among them)."""
    world, tp = _shard_world(cfg), _tp(cfg)
    if tp == 1:
        return model, world, rank % world
    if cfg.model.name == "gpt":  # the manual vocab-parallel split (tp/vocab.py), FSDP2 over shard x cp
        from parallel_lab.strategies.tp.gpt_predict import split_meta_gpt

        return split_meta_gpt(cfg, model, rank), world, rank // tp
    from parallel_lab.strategies.tp.predict import split_meta_vit

    return split_meta_vit(cfg, model, rank % tp), world, rank // tp


def shard_layout(params, world: int, rank: int) -> list[tuple[int, int]]:
    """(padded shard numel, numel rank holds) of every parameter given, in their order."""
    layout = []
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        rest = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        held, per = chunk_rows(rows, world, rank)
        layout.append((per * rest, held * rest))
    return layout


def sharded_params(model: torch.nn.Module) -> list:
    """The parameters fully_shard shards: all but the experts expert parallelism holds whole (strategies/ep/)."""
    experts = expert_ids(model)
    return [p for p in model.parameters() if id(p) not in experts]


def _ep_dims(cfg: DictConfig) -> MeshDims:
    """The data-parallel dims expert parallelism spans (fsdp/rules.py ``FSDPPlan.dims`` at tp = cp = 1,
    the only layouts ep runs in): HSDP's replicate x shard, or one shard group of the world."""
    ep = ep_degree(cfg)
    if _tp(cfg) > 1:  # FSDP2 x TP x EP: ep over the shard ranks of one tp coordinate
        return MeshDims(shard=cfg.world_size // _tp(cfg), tp=_tp(cfg), ep=ep, named=("shard", "tp"))
    if cfg.strategy.sharding == "hybrid":
        return MeshDims(replicate=cfg.strategy.replicate, shard=_shard_world(cfg), ep=ep, named=("replicate", "shard"))
    return MeshDims(shard=cfg.world_size, ep=ep)


def predict_fsdp2_memory(cfg: DictConfig, model: torch.nn.Module, rank: int) -> dict[str, int]:
    """Under ep (strategies/ep/) the rank's own experts are held whole beside the shards."""
    local, world, index = _sharded(cfg, model, rank)
    experts = local_expert_numels(_ep_dims(cfg), model, rank)
    layout = shard_layout(sharded_params(local), world, index) + [(n, n) for n in experts]
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
    if ep_degree(cfg) > 1:  # full or hybrid (fsdp/rules.py), cp = 1; tp under full
        dims = _ep_dims(cfg)
        comm = fsdp_ep_comm(sharded_params(_sharded(cfg, model, rank)[0]), sum(local_expert_numels(dims, model, rank)),
                            dims, rank, cfg)  # fmt: skip
        if dims.tp > 1:
            comm = _added(comm, {"all_reduce": megatron_all_reduce_bytes(cfg, model)})
        micro = cfg.trainer.global_batch // (dims.data_parallel_size * cfg.trainer.grad_accum)
        return _added(comm, balanced_comm(cfg, model, micro))  # the exchanges with every expert equally loaded
    sharding, accum = cfg.strategy.sharding, cfg.trainer.grad_accum
    if sharding == "hybrid" and (cfg.strategy.get("cp") or 1) < 2:
        return None  # plain HSDP is not predicted (docs/meshes.md measures it; plan/recommend.py never ranks it)
    # Every micro-batch's forward gathers and its backward reduces (fsdp/strategy.py train_step has
    # no no_sync: FSDP syncs the gradients at each backward): each per step is accum x its bytes.
    if sharding == "no_shard":
        return {"all_reduce": accum * 2.0 * 4 * sum(p.numel() for p in model.parameters())}
    local, world, index = _sharded(cfg, model, rank)
    full_padded = 4 * sum(p for p, _ in shard_layout(sharded_params(local), world, index)) * world
    gathers = 1 if sharding == "grad_op" else 2
    # bf16: parameters are all-gathered in bf16; gradients are reduce-scattered in fp32 (reduce_dtype)
    gathered = full_padded // (2 if _bf16(cfg) else 1)
    comm = {"all_gather_single": float(accum * gathers * gathered), "reduce_scatter_single": float(accum * full_padded)}
    if sharding == "hybrid":  # HSDP x CP: each reduced padded shard all-reduced over replicate (counted twice)
        comm["all_reduce"] = float(accum * 2 * full_padded // world)
    if _tp(cfg) > 1:
        comm["all_reduce"] = comm.get("all_reduce", 0.0) + megatron_all_reduce_bytes(cfg, model)
    return comm


def fsdp_ep_comm(dense: list, expert_numel: int, dims: MeshDims, rank: int, cfg: DictConfig) -> dict[str, float]:
    """Per step and rank under strategy.ep, all but the exchanges (counter units, comm/counter.py):
    fully_shard's over the shard group, on the dense parameters ``dense`` padded as it pads them (two
    all-gathers and one reduce-scatter a micro-batch); HSDP's all-reduce of the padded gradient
    shard over the replicas (2 x its bytes a micro-batch: FSDP2 reduces at every backward); the
    experts' all-reduce over the ranks holding the same ones (2 x the rank's ``expert_numel`` fp32
    elements once a step, ep/parallel.py; none where one rank holds them)."""
    accum, shard = cfg.trainer.grad_accum, dims.shard
    padded = 4 * sum(p for p, _ in shard_layout(dense, shard, dims.coords(rank)["shard"]))
    comm = {"all_gather_single": 2.0 * accum * shard * padded, "reduce_scatter_single": float(accum * shard * padded)}
    reduced = 2.0 * accum * padded if dims.replicate > 1 else 0.0
    if dims.data_parallel_size > dims.ep:
        reduced += 2.0 * 4 * expert_numel
    return _added(comm, {"all_reduce": reduced} if reduced else {})


def _added(comm: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    return {op: comm.get(op, 0.0) + more.get(op, 0.0) for op in {**comm, **more}}


def megatron_all_reduce_bytes(cfg: DictConfig, model: torch.nn.Module) -> float:
    """FSDP2 x TP's Megatron collectives per step and rank (tp/predict.py ``vit_comm_formula``
    without sequence parallelism, DTensor's split): 4 all-reduces a block of the micro-batch's
    (b, tokens/cp, h) activation, 2 an MoE block (its MLP whole, ep's)."""
    from parallel_lab.strategies.cp.rules import cp_of, vit_tokens
    from parallel_lab.strategies.tp.megatron import blocks, dense_mlp
    from parallel_lab.strategies.tp.predict import vit_comm_formula

    cp, accum = cp_of(cfg), cfg.trainer.grad_accum
    batch = cfg.trainer.global_batch // accum // (cfg.world_size // (cp * _tp(cfg)))
    if cfg.model.name == "gpt":  # the vocab-parallel formula at seq/cp tokens (tp/gpt_predict.py)
        from parallel_lab.models.gpt_sizes import gpt_sizes
        from parallel_lab.strategies.tp.gpt_predict import gpt_comm_formula

        sizes = gpt_sizes(cfg.model)
        formula = gpt_comm_formula(batch, sizes["seq"] // cp, sizes["hidden"], sizes["layers"], False)
        return accum * formula["all_reduce"]
    dim = model.embed.pos.shape[-1]
    depth = sum(1 + dense_mlp(model, b) for b in blocks(model)) / 2
    per_micro = vit_comm_formula(batch, vit_tokens(cfg) // cp, dim, depth, False, "dtensor")
    return accum * per_micro["all_reduce"]
