"""From command-line overrides to the validated configs the planner predicts for.

The config is composed exactly as ``python -m parallel_lab`` composes it (``config.compose``),
given what a run's validation derives (a DeepSpeed file's settings, ``trainer.precision`` as the
strategy's own precision key) and checked with the run's own rules (``config.validate.check_split``),
so a tp degree that does not divide a width, or more pipeline stages than blocks, is the same
one-line error as a run. What the planner leaves out is the machine: no world-size ceiling, no
memory or core check.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from parallel_lab.config import compose_config
from parallel_lab.config.validate import apply_precision, check_split
from parallel_lab.errors import ConfigError
from parallel_lab.strategies import get_strategy_rules, sweep_names
from parallel_lab.strategies.zero.ds_file import adopt_ds_files


@dataclass
class Planned:
    """One (strategy, world size): a validated config, or the one-line reason it cannot run."""

    strategy: str
    world_size: int
    cfg: DictConfig | None
    error: str | None = None


def _given(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").partition("=")[0] == key for o in overrides)


def _degree(cfg: DictConfig, rules: type, key: str) -> int:
    """strategy.<key> at this world size: the world divided by the product of the mesh's other
    degrees (the strategy's own MeshDims: replicate, and a pipeline's tensor-parallel degree), so
    a pipeline with strategy.tp=2 at world 8 plans 4 stages."""
    others = rules.dims(cfg).world // max(1, int(cfg.strategy[key]))
    return max(1, cfg.world_size // max(1, others))


def _copy(cfg: DictConfig) -> DictConfig:
    """A deep copy of a whole config: a pickle round trip gives the same nodes, types and flags as
    ``copy.deepcopy`` in about a third of the time (OmegaConf's ``__deepcopy__`` walks every node in
    Python; the recommender copies a config per candidate, hundreds)."""
    try:
        return pickle.loads(pickle.dumps(cfg))
    except (pickle.PicklingError, AttributeError, TypeError):  # a value pickle cannot name (a local class)
        return copy.deepcopy(cfg)


def _at_world(base: DictConfig, overrides: list[str], world: int, scale: bool) -> DictConfig:
    """The config at this world size, validated (raises ConfigError)."""
    cfg = _copy(base)
    # The strategy's torch-free rules (its class's ``plan``): a refused split is refused before torch.
    rules = get_strategy_rules(cfg.strategy.name)
    # What a run's validate() applies before its checks: a DeepSpeed file's settings
    # (strategy.ds_config, trainer.recipe) and trainer.precision=bf16 turned into the strategy's own
    # key (a strategy without bf16 refuses, here as a row).
    adopt_ds_files(cfg, overrides)
    apply_precision(cfg, overrides)
    if world < 1:
        raise ConfigError(f"world size {world} is out of range; use world sizes >= 1 (plan.world_sizes=[1,2,4])")
    cfg.world_size = 1 if rules.single_process else world
    # The degree that, times strategy.replicate, makes the world size (tp, pp): set from each planned
    # world size unless given on the command line.
    key = rules.degree_key
    if key and not _given(overrides, f"strategy.{key}"):
        cfg.strategy[key] = _degree(cfg, rules, key)
    if scale:
        # Weak scaling: every rank keeps the micro-batch it has at the configured world_size.
        reference = _copy(base)
        if key and not _given(overrides, f"strategy.{key}"):
            reference.strategy[key] = _degree(reference, rules, key)
        t = cfg.trainer
        micro = max(1, t.global_batch // (rules.data_parallel_size(reference) * t.grad_accum))
        t.global_batch = micro * rules.data_parallel_size(cfg) * t.grad_accum
        t.global_batch = max(t.global_batch, rules.min_global_batch(cfg))
    check_split(cfg, rules)
    return cfg


# Overrides that may reach into the strategy group or what composes it: with one of them the
# strategy's config is composed by Hydra; without, it is its yaml's content (``name`` over its
# ``Options``: conf/strategy/<name>.yaml), one compose less a strategy (every row of a plan table, ten
# per recommendation: ~0.1-0.4 s each).
COMPOSED_BY_HYDRA = ("strategy", "experiment", "hydra")


def with_strategy(base: DictConfig, overrides: list[str], name: str) -> DictConfig:
    """What ``compose_config([*overrides, f"strategy={name}"])`` returns, from ``base`` (the
    overrides' composed config) with its strategy node swapped for ``name``'s."""
    from omegaconf import open_dict

    if any(a.lstrip("+~").startswith(COMPOSED_BY_HYDRA) for a in overrides):
        return compose_config([*overrides, f"strategy={name}"])
    cfg = copy.deepcopy(base)
    with open_dict(cfg):
        cfg.strategy = OmegaConf.merge(OmegaConf.structured(get_strategy_rules(name).Options), {"name": name})
    return cfg


def planned_configs(overrides: list[str]) -> list[Planned]:
    """Every (strategy, world size) to predict. With ``strategy=`` given and one world size, a
    config the run would refuse raises its ConfigError (exit 2); otherwise it becomes a row that
    says why it cannot run, and the other rows are still planned."""
    base = compose_config(overrides)
    from parallel_lab.models import validate_model_config

    validate_model_config(base.model)  # wrong for every strategy: an error, not a row per strategy
    chosen = _given(overrides, "strategy")
    names = [base.strategy.name] if chosen else sweep_names()
    worlds = [int(w) for w in base.plan.world_sizes] or [int(base.world_size)]
    scale = bool(base.plan.world_sizes)
    out = []
    for name in names:
        cfg_n = base if chosen else with_strategy(base, overrides, name)  # one compose for all
        for world in [1] if get_strategy_rules(name).single_process and scale else worlds:
            try:
                out.append(Planned(name, world, _at_world(cfg_n, overrides, world, scale)))
            except ConfigError as exc:
                if chosen and len(worlds) == 1:
                    raise
                out.append(Planned(name, world, None, str(exc)))
    return out
