"""``@register``: the table from ``strategy=<name>`` to its class, filled as each strategy module is
imported; and ``@register_rules``: the table from the same name to its parent-side rules (its
``PlanRules`` subclass, which names its ``Options``), filled by the torch-free rules modules
(``<name>_rules.py``, ``<folder>/rules.py``), so the parent composes, lists and validates a config
without importing torch (tests/unit/test_refusal_imports.py). A module of its own, so a strategy
module imports it without importing the package root that discovers every strategy module (no
import circle: tests/unit/test_layers.py)."""

from __future__ import annotations

from typing import Callable

_REGISTRY: dict[str, type] = {}
_RULES: dict[str, type] = {}


def register_rules(*names: str) -> Callable[[type], type]:
    """Class decorator for a ``PlanRules`` subclass: the parent's rules of every strategy named."""

    def wrap(plan: type) -> type:
        for name in names:
            if name in _RULES and _RULES[name] is not plan:
                raise RuntimeError(f"strategy '{name}' has two sets of rules: {_RULES[name].__name__}, {plan.__name__}")
            _RULES[name] = plan
        return plan

    return wrap


def register(*names: str) -> Callable[[type], type]:
    """Class decorator: make the class the strategy for every name given."""

    def wrap(cls: type) -> type:
        _check_state_hooks(cls, names)
        for name in names:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise RuntimeError(f"strategy '{name}' registered twice")
            if name in _RULES and not issubclass(cls.plan, _RULES[name]):
                raise RuntimeError(
                    f"strategy '{name}' ({cls.__name__}) plans with {cls.plan.__name__}, but its rules module "
                    f"registered {_RULES[name].__name__}: one home for its rules"
                )
            _REGISTRY[name] = cls
        return cls

    return wrap


def _check_state_hooks(cls: type, names: tuple[str, ...]) -> None:
    """A strategy must say where its model state lives; refuse it at registration, not mid-run."""
    from parallel_lab.strategies.base import STATE_HOOKS

    def abstract(hook: str) -> bool:
        part, method = hook.split(".")
        return getattr(getattr(getattr(cls, part, None), method, None), "__isabstractmethod__", False)

    missing = [hook for hook in STATE_HOOKS if abstract(hook)]
    if missing:
        raise TypeError(
            f"strategy '{names[0]}' ({cls.__name__}) does not say how it saves, loads, gathers and accounts its "
            f"model state: define {', '.join(missing)} (its State and Memory parts), or use ReplicatedState "
            f"and ReplicatedMemory (parallel_lab/strategies/replicated.py) if every rank holds the whole model"
        )
