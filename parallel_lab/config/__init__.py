"""Configuration: the schema (one home for every default), Hydra composition, validation.

- ``schema``: the dataclasses, a comment per field; ``conf/*.yaml`` hold only what differs.
- ``compose``: the one in-process Hydra compose, with one-line errors for bad overrides, and the
  registration of the schemas and resolvers the yaml files use.
- ``validate``: the parent's checks and the resolved ``<run_dir>/config.yaml`` workers read.
- ``resources``: whether a validated run fits this machine's memory and cores.
"""

from parallel_lab.config.compose import (
    CONF_DIR,
    CONFIG_GROUPS,
    Checked,
    available_options,
    check_group_overrides,
    check_overrides_compose,
    choices_text,
    compose_config,
    register_configs,
    run_config_over_groups,
)
from parallel_lab.config.schema import Config
from parallel_lab.config.validate import load_run_config, validate, write_run_config

__all__ = [
    "CONF_DIR",
    "CONFIG_GROUPS",
    "Checked",
    "Config",
    "available_options",
    "check_group_overrides",
    "check_overrides_compose",
    "choices_text",
    "compose_config",
    "load_run_config",
    "register_configs",
    "run_config_over_groups",
    "validate",
    "write_run_config",
]
