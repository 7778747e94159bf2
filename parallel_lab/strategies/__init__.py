"""Registry of strategies: ``strategy=<name>`` -> one small Strategy class.

Each module (or folder) in this package registers its classes with ``@register("name")``, and
so may a plugin module outside it (``PARALLEL_LAB_PLUGINS``, see ``parallel_lab.plugins``): one
class and one yaml is all a new strategy needs; the sweep, the report and the benchmarks list
strategies from here. Modules must not import heavy optional packages (deepspeed) at import time:
the parent imports them all to validate.
"""

from __future__ import annotations

import importlib
import pkgutil

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.registry import _REGISTRY, register

__all__ = ["register", "registered_names", "sweep_names", "options_schemas", "get_strategy_class"]


def _discover() -> None:
    from parallel_lab.plugins import import_plugins

    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    import_plugins()


def registered_names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def sweep_names() -> list[str]:
    """Every strategy, the baseline (``single``) first: what a comparison of all of them runs."""
    names = registered_names()
    return sorted(names, key=lambda name: (name != "single", name))


def options_schemas() -> dict[str, type]:
    """name -> the Options dataclass that holds the strategy's options, defaults and their meaning."""
    _discover()
    return {name: cls.Options for name, cls in sorted(_REGISTRY.items())}


def get_strategy_class(name: str) -> type:
    _discover()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown strategy '{name}'; choose one of: {', '.join(sorted(_REGISTRY))} (strategy=<name>)")
    return _REGISTRY[name]
