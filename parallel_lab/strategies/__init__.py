"""Registry of strategies: ``strategy=<name>`` -> one small Strategy class, and its rules.

Each strategy has a runtime class (a module or folder in this package, ``@register("name")``) and
its parent-side rules, the ``PlanRules`` subclass that names its ``Options`` (``@register_rules``),
in a module that imports no torch: ``<name>_rules.py`` beside a flat module, ``<folder>/rules.py``
in a folder (imported by the folder's ``__init__``, whose ``load_runtime`` imports the rest). The
parent lists, composes and validates from the rules alone (``registered_names``, ``options_schemas``,
``get_strategy_rules``), so bad input is refused before torch is imported; workers, the planner and
benchmarks get the classes (``get_strategy_class``). A plugin module (``PARALLEL_LAB_PLUGINS``,
``parallel_lab.plugins``) registers a class whose ``plan`` is its rules. The sweep, the report and
the benchmarks list strategies from here. No module may import heavy optional packages
(deepspeed) at import time.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.registry import _REGISTRY, _RULES, register, register_rules

__all__ = [
    "register",
    "register_rules",
    "registered_names",
    "sweep_names",
    "options_schemas",
    "get_strategy_rules",
    "get_strategy_class",
]
RULES_SUFFIX = "_rules"  # a flat strategy module's torch-free rules: <name>_rules.py


def _discover_rules() -> None:
    """Import every rules module (torch-free) and the plugins."""
    from parallel_lab.plugins import plugin_names

    _rules_imported(tuple(plugin_names()))


def _discover() -> None:
    """Import every strategy module, runtime classes and all (torch)."""
    from parallel_lab.plugins import plugin_names

    _runtime_imported(tuple(plugin_names()))


# Once per plugin list (lru_cache: a failed import is not remembered and raises again next time):
# the package's modules do not change in a process, and listing them costs ~1 ms a call (pkgutil
# reads the folder), which the recommender paid ~400 times a recommendation.
@functools.lru_cache(maxsize=None)
def _rules_imported(plugins: tuple[str, ...]) -> None:
    from parallel_lab.plugins import import_plugins

    for info in pkgutil.iter_modules(__path__):
        if info.ispkg or info.name.endswith(RULES_SUFFIX):
            importlib.import_module(f"{__name__}.{info.name}")
    import_plugins()


@functools.lru_cache(maxsize=None)
def _runtime_imported(plugins: tuple[str, ...]) -> None:
    from parallel_lab.plugins import import_plugins

    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            load_runtime = getattr(module, "load_runtime", None)  # a folder's runtime modules (torch)
            if load_runtime is not None:
                load_runtime()
    import_plugins()


def registered_names() -> list[str]:
    _discover_rules()
    return sorted(set(_RULES) | set(_REGISTRY))


def sweep_names() -> list[str]:
    """Every strategy, the baseline (``single``) first: what a comparison of all of them runs."""
    names = registered_names()
    return sorted(names, key=lambda name: (name != "single", name))


def get_strategy_rules(name: str) -> type:
    """The strategy's ``PlanRules`` subclass (its ``Options`` and every parent-side rule), torch-free
    for the built-in strategies; a plugin's class's ``plan``."""
    _discover_rules()
    if name in _RULES:
        return _RULES[name]
    if name in _REGISTRY:
        return _REGISTRY[name].plan
    raise ConfigError(f"unknown strategy '{name}'; choose one of: {', '.join(registered_names())} (strategy=<name>)")


def options_schemas() -> dict[str, type]:
    """name -> the Options dataclass that holds the strategy's options, defaults and their meaning."""
    return {name: get_strategy_rules(name).Options for name in registered_names()}


def get_strategy_class(name: str) -> type:
    _discover()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown strategy '{name}'; choose one of: {', '.join(sorted(_REGISTRY))} (strategy=<name>)")
    return _REGISTRY[name]
