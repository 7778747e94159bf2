"""How ``pp`` cuts the model, on the meta device: the chunks each rank holds (the cut is
``plan.py``'s, the same setup makes), their input shapes, FLOP shares and the bytes zero bubble's
split saves, each cached per model. Torch-free at import (``rules.py`` imports it in the parent):
what needs the model imports torch inside."""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

from omegaconf import DictConfig, OmegaConf

from parallel_lab.strategies.mesh import MeshDims

if TYPE_CHECKING:
    import torch
    from torch import nn


def meta_model(cfg: DictConfig) -> nn.Sequential:
    """The model's structure without weights (meta device): for planning and shape inference. One per
    model config: validation asks for it twice per config (the recommender validates hundreds), and
    no caller changes it."""
    return _meta_model(_ModelKey(cfg.model))


class _ModelKey:
    """A model config, hashed and compared by its yaml (a DictConfig is not hashable)."""

    def __init__(self, model_cfg: DictConfig) -> None:
        self.cfg, self.text = model_cfg, OmegaConf.to_yaml(model_cfg)

    def __hash__(self) -> int:
        return hash(self.text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ModelKey) and other.text == self.text


@functools.lru_cache(maxsize=8)
def _meta_model(key: _ModelKey) -> nn.Sequential:
    from parallel_lab.models import build_meta_model

    return build_meta_model(key.cfg)


@functools.lru_cache(maxsize=32)
def _cut(model: nn.Sequential, stages: int, virtual: int, cuts: tuple, balance: str, times: tuple) -> tuple:
    """plan_stages of these options, once per planning (the planner asks for every rank)."""
    from parallel_lab.strategies.pp.plan import block_costs, plan_stages

    costs = block_costs(model, balance, times)
    return tuple(tuple(c) for c in plan_stages(model, stages, list(cuts), costs, virtual))


def chunk_names(cfg: DictConfig, model: nn.Sequential) -> list[list[str]]:
    """Every chunk's child names, in model order: the cut setup makes (``plan.chunk_plan``)."""
    o = cfg.strategy
    key = (o.stages, o.get("virtual_stages", 1), tuple(o.cuts), str(o.balance), tuple(o.block_times))
    return [list(c) for c in _cut(model, *key)]


def chunk_modules(cfg: DictConfig, model: nn.Sequential) -> list[nn.Sequential]:
    return _modules(model, chunk_names(cfg, model))


def stage_of(cfg: DictConfig, rank: int) -> int:
    """Rank ``rank``'s pipeline stage: its pp coordinate on the (replicate, pp, tp) mesh."""
    return pp_dims(cfg.strategy).coords(rank)["pp"]


def ties_across_stages(cfg: DictConfig) -> bool:
    """The gpt's tied embedding in a pipeline of several stages: the first stage's word embedding is
    the last stage's output projection, which holds a copy of it (pp/tied.py)."""
    if cfg.model.get("name") != "gpt" or cfg.strategy.stages < 2:
        return False
    from parallel_lab.models.gpt_sizes import gpt_sizes

    return bool(gpt_sizes(cfg.model)["tied"])


def in_embedding_group(cfg: DictConfig, stage: int) -> bool:
    """Whether ``stage`` holds a copy of a tied embedding (the first stage or the last: pp/tied.py)."""
    return ties_across_stages(cfg) and stage in (0, cfg.strategy.stages - 1)


def held_chunks(cfg: DictConfig, model: nn.Sequential, stage: int) -> list[nn.Sequential]:
    """``chunk_modules`` as ``stage`` runs them: a tied pipeline's last stage runs its last chunk with
    its copy of the embedding in front (pp/tied.py; it passes the input through)."""
    chunks = chunk_modules(cfg, model)
    if stage > 0 and in_embedding_group(cfg, stage):
        from torch import nn

        from parallel_lab.strategies.pp.tied import EMBED, planned_copy

        chunks[-1] = nn.Sequential(OrderedDict([(EMBED, planned_copy(model)), *chunks[-1].named_children()]))
    return chunks


def rank_module(cfg: DictConfig, model: nn.Sequential, rank: int) -> nn.Sequential:
    """Every block rank ``rank`` holds (its chunks), in model order, unsplit (``split_meta_stage``:
    as a tp rank holds them); the last stage of a tied pipeline also its copy of the embedding, as
    ``embed`` (pp/tied.py)."""
    from torch import nn

    from parallel_lab.strategies.pp.plan import rank_chunks

    names = chunk_names(cfg, model)
    stage = stage_of(cfg, rank)
    mine = [(n, model.get_submodule(n)) for c in rank_chunks(cfg.strategy, stage) for n in names[c]]
    if stage > 0 and in_embedding_group(cfg, stage):
        from parallel_lab.strategies.pp.tied import EMBED, planned_copy

        mine.insert(0, (EMBED, planned_copy(model)))
    return nn.Sequential(OrderedDict(mine))


def _stage_module(cfg: DictConfig, model: nn.Sequential, rank: int) -> nn.Sequential:
    return rank_module(cfg, model, rank)  # the name tests/unit/test_plantime.py uses


def chunk_inputs(cfg: DictConfig, model: nn.Sequential, batch: int) -> list[torch.Size]:
    """The input shape of every chunk and, last, the model's output (meta forward: no compute)."""
    return list(_chunk_shapes(weakref.ref(model), _names_key(cfg, model), batch))


def chunk_shares(cfg: DictConfig, model: nn.Sequential) -> list[float]:
    """Each chunk's share of the model's FLOPs (``plan.stage_shares``)."""
    return list(_chunk_flop_shares(weakref.ref(model), _names_key(cfg, model)))


# Remembered per (model, cut): the planner asks the same for every rank and the recommender for
# every candidate (a meta forward of the vit costs ~60 ms; 180 of them took 11 s). Keyed by a weak
# reference: a model is not kept alive, and one built later at the same address is another key.
@functools.lru_cache(maxsize=256)
def _chunk_shapes(model_ref: weakref.ref, names: tuple, batch: int) -> tuple[torch.Size, ...]:
    import torch

    from parallel_lab.models import input_shape, sample_input

    model = model_ref()
    x = sample_input(model, batch, input_shape(model))
    shapes = []
    with torch.no_grad():
        for chunk in _modules(model, names):
            shapes.append(x.shape)
            x = chunk(x)
    return (*shapes, x.shape)


def _refs(chunk: nn.Module) -> tuple[weakref.ref, ...]:
    return tuple(weakref.ref(c) for c in chunk.children()) or (weakref.ref(chunk),)


@functools.lru_cache(maxsize=256)
def _split_bytes(refs: tuple[weakref.ref, ...], batch: int, shape: tuple, loss: bool) -> tuple[int, int]:
    """``zero_bubble.split_bytes`` of the chunk made of these modules, once per planning (the
    recommender plans every candidate's ranks: the same chunks many times)."""
    from torch import nn

    from parallel_lab.strategies.pp.zero_bubble import split_bytes

    modules = [r() for r in refs]
    return split_bytes(nn.Sequential(*modules) if len(modules) > 1 else modules[0], batch, shape, loss)


@functools.lru_cache(maxsize=256)
def _chunk_flop_shares(model_ref: weakref.ref, names: tuple) -> tuple[float, ...]:
    from parallel_lab.strategies.pp.plan import stage_shares

    return tuple(stage_shares(_modules(model_ref(), names)))


def _modules(model: nn.Sequential, names: Sequence[Sequence[str]]) -> list[nn.Sequential]:
    from torch import nn

    return [nn.Sequential(OrderedDict((n, model.get_submodule(n)) for n in chunk)) for chunk in names]


def _names_key(cfg: DictConfig, model: nn.Sequential) -> tuple:
    return tuple(map(tuple, chunk_names(cfg, model)))


def pp_dims(opts: DictConfig) -> MeshDims:
    """strategy.replicate pipelines of strategy.stages stages, each stage split over strategy.tp
    consecutive ranks (rank = (replica x stages + stage) x tp + tp rank: a pipeline's ranks are tp
    apart); the pipeline's group is laid out even at one stage (its sends stay inside it). With
    strategy.cp: replicate x cp x pp, a pipeline the ranks of one (replicate, cp) (pp/cp_rules.py)."""
    cp = opts.get("cp") or 1
    return MeshDims(replicate=opts.replicate, cp=cp, pp=opts.stages, tp=opts.get("tp", 1), named=("pp",))
