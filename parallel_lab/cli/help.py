"""``python -m parallel_lab --help``: conf/config.yaml's ``hydra.help.template`` filled in.

A bare ``--help`` is built here without Hydra (whose import is most of a ~0.9 s CPU ``--help``):
the default config is the schema's dataclass defaults (``config/schema.py``, the default strategy's
``Options``) with the yaml files of the defaults list laid over them, as Hydra's composition lays
them (a key keeps its place, a new key goes last), and the template's three interpolations are
filled in by name. Anything it does not know how to compose (an override, a defaults entry of
another shape, another interpolation) falls back to Hydra's composition, which ``help_text``
always uses for ``--help`` with overrides. tests/unit/test_help.py holds the two to the same text.
"""

from __future__ import annotations

import dataclasses
import enum
import string
from pathlib import Path
from typing import Any

import yaml

from parallel_lab.config import CONF_DIR, choices_text

BARE = (["--help"], ["-h"])  # the invocations the quick path answers; anything else composes with Hydra
OPTIONS_ENTRY = "/strategy_options/"  # conf/strategy/<name>.yaml: defaults [/strategy_options/<name>@_here_]
HELP_FIELDS = {"${hydra.help.header}": "header", "${hydra.help.footer}": "footer"}
CHOICES = "${parallel_lab_choices:}"  # the resolver config/compose.py registers for Hydra's path
HYDRA_LISTS = ("FLAGS_HELP", "HYDRA_CONFIG_GROUPS", "APP_CONFIG_GROUPS")  # placeholders only Hydra fills


class NotPlain(Exception):
    """The config uses something the quick path does not compose: Hydra composes it instead."""


def help_text(argv: list[str]) -> str | None:
    """The --help text (None: not asked for, or a template that lists Hydra's own groups: Hydra
    prints it then). A bare --help never imports Hydra."""
    if argv in BARE:
        try:
            return quick_help()
        except NotPlain:
            pass
    return hydra_help(argv)


def hydra_help(argv: list[str]) -> str | None:
    """--help as Hydra composes it (the user's overrides applied), without Hydra listing every config
    group's options for placeholders the template does not use (most of a ~1.6 s ``--help``)."""
    from hydra._internal.utils import get_args_parser
    from omegaconf import OmegaConf, open_dict

    from parallel_lab.config import compose_config

    known, _ = get_args_parser().parse_known_args(argv)
    if not known.help:
        return None
    cfg = compose_config([a for a in known.overrides if not a.lstrip("+~").startswith("hydra")], with_hydra=True)
    template = cfg.hydra.help.template
    if any(f"${key}" in template for key in HYDRA_LISTS):
        return None
    with open_dict(cfg):
        del cfg["hydra"]
    return string.Template(template).substitute(CONFIG=OmegaConf.to_yaml(cfg, resolve=known.resolve))


def quick_help() -> str:
    """The bare --help, from conf/ and the schema, with no Hydra; NotPlain where it cannot."""
    from omegaconf import OmegaConf  # its yaml writer: the same quoting and layout as Hydra's path

    root = _load(CONF_DIR / "config.yaml")
    help_node = root.get("hydra", {}).get("help", {})
    template = help_node.get("template", "")
    if any(f"${key}" in template for key in HYDRA_LISTS):
        raise NotPlain("the template lists Hydra's groups")
    for placeholder, key in HELP_FIELDS.items():
        template = template.replace(placeholder, help_node.get(key, ""))
    template = template.replace(CHOICES, choices_text())
    if "${" in template:
        raise NotPlain("an interpolation the quick path does not fill")
    return string.Template(template).substitute(CONFIG=OmegaConf.to_yaml(default_config(root)))


def default_config(root: dict) -> dict:
    """conf/config.yaml's defaults list composed over the schema (``base_config``), ``_self_`` last."""
    from parallel_lab.config.schema import Config

    cfg: dict = {}
    for entry in root.get("defaults", []):
        if entry == "base_config":
            cfg = _merge(cfg, _plain(Config()))
        elif entry == "_self_":
            cfg = _merge(cfg, {key: value for key, value in root.items() if key not in ("defaults", "hydra")})
        elif isinstance(entry, dict) and len(entry) == 1:
            ((group, option),) = entry.items()
            cfg = _merge(cfg, {group: _group_node(group, option)})
        else:
            raise NotPlain(f"defaults entry {entry!r}")
    if "_self_" not in root.get("defaults", []):
        raise NotPlain("no _self_ in the defaults list")
    return cfg


def _group_node(group: str, option: str) -> dict:
    """conf/<group>/<option>.yaml over its own defaults (a strategy's Options dataclass)."""
    from parallel_lab.strategies import options_schemas

    node = _load(CONF_DIR / group / f"{option}.yaml")
    out: dict = {}
    for entry in node.pop("defaults", []):
        name = entry.removeprefix(OPTIONS_ENTRY).removesuffix("@_here_") if isinstance(entry, str) else None
        if not name or name == entry or "/" in name or name not in options_schemas():
            raise NotPlain(f"{group}/{option}.yaml defaults entry {entry!r}")
        out = _merge(out, _plain(options_schemas()[name]()))
    if str(node.get("_self_", "")).startswith("#") or any(key.startswith("_") for key in node):
        raise NotPlain(f"{group}/{option}.yaml has a package directive")
    return _merge(out, node)


def _load(path: Path) -> dict:
    text = path.read_text()
    if text.lstrip().startswith("# @package") or "\n# @package" in text:
        raise NotPlain(f"{path.name} sets its package")
    return yaml.safe_load(text) or {}


def _plain(value: Any) -> Any:
    """A dataclass instance as the nested dict OmegaConf makes of it (fields in order, an Enum by name)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _merge(base: dict, over: dict) -> dict:
    """``over`` laid over ``base`` as OmegaConf merges: dicts key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
