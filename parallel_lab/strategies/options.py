"""A strategy's options (``strategy.<key>``): the dataclass every strategy's ``Options`` extends, and
their validation against it (the parent, before any process starts)."""

from __future__ import annotations

import copy
import functools
import pickle
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallel_lab.choices import choice_error
from parallel_lab.errors import ConfigError, one_line


@dataclass
class StrategyOptions:
    """Options every strategy yaml has. Subclasses add their own fields (``strategy.<key>``)."""

    name: str = "?"  # the registered name (strategy=<name>), set by the yaml


@functools.lru_cache(maxsize=None)
def _schema(options_cls: type) -> DictConfig | bytes:
    """One schema per Options class, pickled where it can be (``_typed`` copies it and never changes
    it). Building it costs ~1 ms of a validation's ~6, and the recommender validates hundreds of configs."""
    schema = OmegaConf.structured(options_cls)
    try:
        return pickle.dumps(schema)
    except (pickle.PicklingError, AttributeError, TypeError):  # an Options class pickle cannot name (a local class)
        return schema


@functools.lru_cache(maxsize=None)
def _defaults(options_cls: type) -> dict:
    """The schema's own values as plain values (what ``OmegaConf.to_container`` of it gives)."""
    schema = _schema(options_cls)
    return OmegaConf.to_container(pickle.loads(schema) if isinstance(schema, bytes) else schema)


def _typed(options_cls: type, plain: dict) -> DictConfig:
    """``OmegaConf.merge(schema, plain)``, the schema copied from its pickle: ``merge`` deep-copies
    its first argument node by node in Python, two thirds of its time here (the recommender merges
    ~200 strategy sections per recommendation). Only the keys whose value is not the schema's own
    (same type, equal) are merged: setting a key to the value it holds changes nothing, and each
    key merged costs ~0.2 ms (a strategy section has ~15, a candidate changes a few). An unknown key,
    or a value of another type (``"2"`` for an int), is merged, so its error or conversion is
    Hydra's own. The same nodes, types and flags either way (tests/unit/test_recommend.py)."""
    schema = _schema(options_cls)
    target = pickle.loads(schema) if isinstance(schema, bytes) else copy.deepcopy(schema)
    defaults = _defaults(options_cls)
    changed = {
        k: v for k, v in plain.items() if k not in defaults or type(v) is not type(defaults[k]) or v != defaults[k]
    }
    target.merge_with(changed)  # what merge does after its copy (the schema is never read-only)
    return target


def validate_options(plan: type, cfg: DictConfig) -> DictConfig:
    """Type-check ``cfg.strategy`` against ``plan.Options`` (unknown keys are errors), then the
    strategy's own rules (``plan.check_options``, ``PlanRules``); the validated options."""
    try:
        # As plain values: a key added with +strategy.<key> must not pass as part of the schema.
        merged = _typed(plan.Options, OmegaConf.to_container(cfg.strategy, resolve=True))
    except OmegaConfBaseException as exc:
        message = choice_error(exc, prefix="strategy.")
        raise ConfigError(message or f"strategy '{cfg.strategy.get('name')}': {one_line(exc.msg)}") from None
    plan.check_options(merged, cfg)
    return merged
