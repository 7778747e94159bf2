"""Registry of strategies: ``strategy=<name>`` -> one small Strategy class.

Each module in this package registers its classes with ``@register("name")``. Modules must not
import heavy optional packages (deepspeed) at import time: the parent imports them all to validate.
"""
from __future__ import annotations

import importlib
import pkgutil

from parallel_lab.errors import ConfigError

_REGISTRY: dict[str, type] = {}


def register(*names: str):
    """Class decorator: make the class the strategy for every name given."""

    def wrap(cls: type) -> type:
        for name in names:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise RuntimeError(f"strategy '{name}' registered twice")
            _REGISTRY[name] = cls
        return cls

    return wrap


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def registered_names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def get_strategy_class(name: str) -> type:
    _discover()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown strategy '{name}'; choose one of: {', '.join(sorted(_REGISTRY))} (strategy=<name>)")
    return _REGISTRY[name]
