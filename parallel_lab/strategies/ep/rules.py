"""Expert parallelism in the parent: the rules ``strategy.ep`` must keep (one line, exit 2, before
any process starts) and what the planner predicts of it (each rank's parameters, the bytes its
exchanges move with every expert equally loaded). Torch-free at import: the refusals run before
torch is loaded; the planner's helpers take the meta model it built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.ep.groups import ep_rank
from parallel_lab.strategies.mesh import MeshDims

if TYPE_CHECKING:
    from torch import nn


def _moe_layers(model: nn.Module) -> list:
    from parallel_lab.models.moe import moe_layers

    return moe_layers(model)


def ep_degree(cfg: DictConfig) -> int:
    return int(cfg.strategy.get("ep", 1) or 1)


def check_ep(cfg: DictConfig, dims: MeshDims) -> None:
    """strategy.ep: a degree >= 1 that divides model.moe_experts and the data-parallel size, on a
    model with MoE layers, without the features its all-to-all does not follow."""
    ep, t = dims.ep, cfg.trainer
    if ep < 1:
        raise ConfigError(f"strategy.ep={ep} must be >= 1 (1 = every rank holds every expert); e.g. strategy.ep=2")
    if ep == 1:
        return
    experts = cfg.model.get("moe_experts") or 0
    if not experts:
        raise ConfigError(
            f"strategy.ep={ep} shards MoE experts, and the model has none; set model.moe_experts (e.g. 4)"
        )
    if experts % ep:
        raise ConfigError(
            f"strategy.ep={ep} does not divide model.moe_experts={experts} (each rank holds experts / ep); "
            f"use an ep that divides {experts}"
        )
    dp = dims.data_parallel_size
    if dp % ep:
        raise ConfigError(
            f"strategy.ep={ep} does not divide the data-parallel size {dp} (ep spans data-parallel ranks); "
            f"use an ep that divides {dp}"
        )
    for key, bad, why in (
        ("grad_clip", t.grad_clip > 0, "the norm would miss the other ranks' experts"),
        ("recompute", _plain(t.get("recompute", "none")) != "none", "it would repeat the all-to-all"),
        ("precision", _plain(t.precision) != "fp32", "the exchange runs in fp32"),
    ):
        if bad:
            raise ConfigError(
                f"trainer.{key}={t.get(key)} with strategy.ep={ep}: {why}; drop trainer.{key} or use strategy.ep=1"
            )


def _plain(value) -> str:
    return str(getattr(value, "value", value))


def held_numels(dims: MeshDims, model: nn.Module, rank: int) -> list[int]:
    """Element counts of the parameters ``rank`` holds: all but the other ranks' experts (shapes of
    the meta model, which holds every expert)."""
    skip = other_experts(model, dims.ep, ep_rank(dims, rank)) if dims.ep > 1 else set()
    return [p.numel() for p in model.parameters() if id(p) not in skip]


def local_expert_numels(dims: MeshDims, model: nn.Module, rank: int) -> list[int]:
    """Element counts of the expert parameters ``rank`` holds (none without ep)."""
    if dims.ep == 1:
        return []
    skip = other_experts(model, dims.ep, ep_rank(dims, rank))
    return [p.numel() for p in model.parameters() if id(p) in expert_ids(model) and id(p) not in skip]


def expert_ids(model: nn.Module) -> set[int]:
    return {id(p) for moe in _moe_layers(model) for p in moe.experts.parameters()}


def other_experts(model: nn.Module, ep: int, share: int) -> set[int]:
    """ids of the expert parameters a rank holding share ``share`` of ``ep`` does not hold."""
    out: set[int] = set()
    for moe in _moe_layers(model):
        local = moe.num_experts // ep
        for i, expert in enumerate(moe.experts):
            if not share * local <= i < (share + 1) * local:
                out |= {id(p) for p in expert.parameters()}
    return out


def balanced_comm(cfg: DictConfig, model: nn.Module, micro_batch: int) -> dict[str, float]:
    """Bytes per step per rank of the exchanges with every expert receiving an equal share (the
    routing decides the real figure; the run records it): per MoE layer and micro-batch, each of the
    micro-batch's tokens' k copies of h fp32 elements sent and received, forward and backward, plus
    the counts' all-gather (ep x E int64)."""
    ep = ep_degree(cfg)
    layers = _moe_layers(model)
    if ep == 1 or not layers:
        return {}
    micro = cfg.trainer.grad_accum
    out = {"all_to_all_single": 0.0, "all_gather_single": 0.0}
    for moe in layers:
        tokens = micro_batch * _tokens(cfg)
        h = moe.router.in_features
        out["all_to_all_single"] += micro * 4 * tokens * moe.topk * h * 4
        out["all_gather_single"] += micro * ep * moe.num_experts * 8
    return out


def expert_parallel_meta(model: nn.Module, dims: MeshDims, rank: int) -> nn.Module:
    """A meta copy of the model as ``rank`` runs it under ep (parallel.py): each MoE layer keeps its
    E / ep experts and dispatches through ep/dispatch.py's code with every expert equally loaded
    (``PlannedDispatch``): the planner counts what it saves. The model itself at ep = 1."""
    if dims.ep == 1 or not _moe_layers(model):
        return model
    import copy

    from torch import nn

    from parallel_lab.strategies.ep.dispatch import PlannedDispatch

    copied, share = copy.deepcopy(model), ep_rank(dims, rank)
    for moe in _moe_layers(copied):
        local = moe.num_experts // dims.ep
        moe.experts = nn.ModuleList(list(moe.experts)[share * local : (share + 1) * local])
        moe.dispatch = PlannedDispatch(dims.ep, share)
    return copied


def _tokens(cfg: DictConfig) -> int:
    """A sample's tokens: the vit's patches or the gpt's model.seq."""
    from parallel_lab.models import IMAGE, sample_shape, vit_sizes

    if cfg.model.name == "gpt":
        return sample_shape(cfg.model)[0]
    return (IMAGE // vit_sizes(cfg.model)["patch"]) ** 2
