"""Strategies from outside the package: ``PARALLEL_LAB_PLUGINS=module[,module...]``.

Each named module is imported (it must be on ``sys.path``, e.g. through ``PYTHONPATH``) after the
built-in strategies, and registers its classes with ``@register("name")`` like they do. Its yaml
files live in a ``conf/`` folder beside the module, laid out like the project's
(``conf/strategy/<name>.yaml``). The variable reaches every worker through the environment, so a
plugin strategy runs under every launcher, in sweeps, the report and the benchmarks.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from parallel_lab.errors import ConfigError

PLUGINS_ENV = "PARALLEL_LAB_PLUGINS"


def plugin_names() -> list[str]:
    return [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]


def import_plugins() -> list:
    """Import every plugin module (a cached no-op after the first time)."""
    modules = []
    for name in plugin_names():
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            raise ConfigError(
                f"{PLUGINS_ENV} names '{name}', which cannot be imported ({exc}); put its folder "
                f"on PYTHONPATH or fix the name"
            ) from None
    return modules


def plugin_config_files(group: str) -> dict[str, Path]:
    """name -> yaml file of every plugin config of one group (conf/<group>/*.yaml beside the module)."""
    found = {}
    for module in import_plugins():
        folder = Path(module.__file__).resolve().parent / "conf" / group
        found.update({path.stem: path for path in sorted(folder.glob("*.yaml"))})
    return found
