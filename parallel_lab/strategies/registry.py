"""``@register``: the table from ``strategy=<name>`` to its class, filled as each strategy module is
imported. A module of its own, so a strategy module imports it without importing the package
root that discovers every strategy module (no import circle: tests/unit/test_layers.py)."""

from __future__ import annotations

from typing import Callable

_REGISTRY: dict[str, type] = {}


def register(*names: str) -> Callable[[type], type]:
    """Class decorator: make the class the strategy for every name given."""

    def wrap(cls: type) -> type:
        _check_state_hooks(cls, names)
        for name in names:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise RuntimeError(f"strategy '{name}' registered twice")
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
