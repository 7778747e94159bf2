"""Hydra composition for every caller: the command line, ``prepare``, tests and benches.

``compose_config`` is the one way to build a config in-process; ``check_group_overrides`` and
``check_overrides_compose`` run before Hydra's own command line, so a typo is one line
(Hydra's report is a page) and nothing is launched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from parallel_lab.choices import choice_error
from parallel_lab.config.memo import Memo, files_digest
from parallel_lab.config.schema import CONFIG_GROUPS, Config
from parallel_lab.errors import ConfigError

if TYPE_CHECKING:  # Hydra is imported where it composes, not here: a bare --help never needs it
    from hydra.types import RunMode
    from omegaconf import DictConfig


def _conf_dir() -> Path:
    """conf/ at the top of a checkout (editable install, PYTHONPATH), or parallel_lab/conf where a
    wheel installed it (setup.py maps the one onto the other)."""
    package = Path(__file__).resolve().parents[1]
    installed, checkout = package / "conf", package.parent / "conf"
    return installed if installed.is_dir() else checkout


CONF_DIR = _conf_dir()


def available_options(group: str) -> list[str]:
    """The names group=<name> accepts: conf/<group>/*.yaml and the plugins' (PARALLEL_LAB_PLUGINS)."""
    from parallel_lab.plugins import plugin_config_files

    return sorted({p.stem for p in (CONF_DIR / group).glob("*.yaml")} | set(plugin_config_files(group)))


def check_group_overrides(argv: list[str]) -> None:
    """Reject ``strategy=nope`` before Hydra does, with one line instead of Hydra's page."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in CONFIG_GROUPS:
            continue
        options = available_options(key)
        for choice in value.split(","):
            if choice and choice not in options:
                raise ConfigError(f"unknown {key} '{choice}'; choose one of: {', '.join(options)} ({key}=<name>)")


HARDWARE = "hardware"  # conf/hardware/<name>.yaml: the GPU cluster profiles plan.hardware=<name> selects


def hardware_overrides(argv: list[str]) -> list[str]:
    """``plan.hardware=<name>`` as the Hydra override that loads conf/hardware/<name>.yaml into
    ``plan.hardware`` (its fields then overridable: ``plan.hardware.inter_node_gbps=800``); an
    unknown name is one line naming the profiles."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key.lstrip("+") != "plan.hardware" or not sep or value in ("null", ""):
            out.append(arg)
            continue
        options = available_options(HARDWARE)
        if value not in options:
            raise ConfigError(
                f"unknown plan.hardware '{value}'; choose one of: {', '.join(options)} "
                f"(or write conf/{HARDWARE}/{value}.yaml)"
            )
        out.append(f"+{HARDWARE}@plan.hardware={value}")
    return out


def describe_compose_error(exc: BaseException) -> str:
    """Hydra/OmegaConf's multi-line error as one line naming the key, value and fix."""
    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    choice = next(filter(None, map(choice_error, chain)), None)
    if choice:  # a value outside a typed key's choices: the line names them
        return choice
    keyed = [e for e in chain if getattr(e, "full_key", None)]
    cause = keyed[0] if keyed else chain[0]
    message = str(getattr(cause, "msg", None) or cause)
    first = " ".join(message.strip().splitlines()[0].split()) if message.strip() else type(cause).__name__
    where = f"'{cause.full_key}': " if keyed else ""
    return (
        f"bad override {where}{first}; fix the value or the key name "
        f"(python -m parallel_lab --cfg job prints every key with its current value)"
    )


def _sweep_variants(argv: list[str]) -> list[list[str]]:
    """Override lists that together use every value of every sweep (a,b,c / range(...)) once."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    choices = []
    for arg in argv:
        override = parser.parse_override(arg)
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()] or [arg])
        else:
            choices.append([arg])
    variants = [[options[0] for options in choices]]
    for i, options in enumerate(choices):
        for option in options[1:]:
            variants.append([*variants[0][:i], option, *variants[0][i + 1 :]])
    return variants


class Checked(NamedTuple):
    """What ``check_overrides_compose`` learnt before Hydra runs."""

    validated: bool  # it validated the single run (and probed its hosts)
    mode_known: bool  # no hydra override but plain values: ``mode`` is what Hydra will compose
    mode: RunMode | None  # hydra.mode of the composed config (None: not set; Hydra decides by --multirun)


def check_overrides_compose(argv: list[str]) -> Checked:
    """Compose the config with the user's overrides before Hydra runs, so a wrong type or an
    unknown key is one line (Hydra's own report is a page) and nothing is launched. A single run
    (no sweep) is also validated here, so bad values are refused before Hydra makes a run folder;
    a sweep goes on past its bad points (each becomes a failed row), so its points are validated
    one by one in their jobs."""
    from hydra._internal.utils import get_args_parser  # Hydra's own command line, flags and all
    from hydra.types import RunMode

    known, _ = get_args_parser().parse_known_args(argv)
    overrides = [a for a in known.overrides if not a.lstrip("+~").startswith("hydra")]
    try:
        variants = _sweep_variants(overrides)
    except Exception as exc:  # a syntax error in an override is one line too
        raise ConfigError(describe_compose_error(exc)) from None
    configs = [compose_config(variant) for variant in variants]
    hydras = [a for a in known.overrides if a not in overrides]
    # hydra.mode=... (and no other hydra.* override: a plain value of hydra.run.dir and the like
    # leaves the mode alone; a hydra/ group, a prefix or an interpolation might not) decides it too
    mode_known = all(re.fullmatch(r"hydra\.[\w.]+=[^$]*", a) for a in hydras)
    modes = [a for a in hydras if a.startswith("hydra.mode=")][-1:]
    mode = compose_config(group_choices(variants[0]) + modes, with_hydra=True).hydra.mode
    if known.help or known.hydra_help:  # nothing runs: the help text only
        return Checked(False, mode_known, mode)
    if len(configs) == 1 and not known.multirun and mode != RunMode.MULTIRUN:
        _validate_before_hydra(configs[0], overrides)
        return Checked(True, mode_known, mode)
    return Checked(False, mode_known, mode)


def group_choices(overrides: list[str]) -> list[str]:
    """The overrides that choose a config group (``model=gpt``, ``+experiment=...``): what decides
    Hydra's own node (its mode) where no override names ``hydra.*``; all of them where one is not a
    plain value override (config/memo.py split_value_overrides)."""
    from parallel_lab.config.memo import split_value_overrides

    as_hydra = hardware_overrides(overrides)  # one for one
    try:
        split = split_value_overrides(as_hydra, _is_group(register_configs()))
    except Exception:  # a syntax error: the composition of all of them says it in one line
        split = None
    return overrides if split is None else [o for o, h in zip(overrides, as_hydra) if h in split[0]]


def _validate_before_hydra(cfg: DictConfig, overrides: list[str]) -> None:
    """validate() without a run folder (Hydra picks it later; the job validates again with it,
    and warns then: not twice), probing the hosts here (the job then does not: not twice either)."""
    from parallel_lab.config.validate import validate

    validate(cfg, explicit=overrides, warn=lambda message: None, reach_hosts=True)


def compose_config(overrides: list[str] | tuple[str, ...] = (), with_hydra: bool = False) -> DictConfig:
    """The config the command line would compose from these overrides, before validation (with
    Hydra's own ``hydra`` node, e.g. its mode, if with_hydra). Bad input is a one-line ConfigError,
    as on the command line. The same overrides again in this process (the conf files, plugins and
    working folder unchanged) give a copy of the first result; value overrides are laid over the
    composition of the group choices alone (config/memo.py)."""
    (result,) = compose_configs([list(overrides)], with_hydra)
    if isinstance(result, ConfigError):
        raise result
    return result


def compose_configs(overrides_list: list[list[str]], with_hydra: bool = False) -> list[DictConfig | ConfigError]:
    """compose_config for each list of overrides; those Hydra must compose share one Hydra context
    (its repository reads each yaml once: about a quarter less a config); a list that fails gives
    its ConfigError."""
    state = register_configs()
    out: list[DictConfig | ConfigError | None] = []
    pending: dict[int, list[str]] = {}
    for index, overrides in enumerate(overrides_list):
        try:
            check_group_overrides(list(overrides))
            hydra_overrides = hardware_overrides(list(overrides))
            out.append(_composed_without_hydra(hydra_overrides, with_hydra, state))
        except ConfigError as exc:
            out.append(exc)
            continue
        if out[-1] is None:
            pending[index] = hydra_overrides
    if pending:
        for index, result in zip(pending, _hydra_compose(list(pending.values()), with_hydra, state)):
            out[index] = result
    return out


def _memo_key(overrides: list[str], with_hydra: bool, state: tuple) -> tuple:
    """Everything that decides a composition: the overrides, the conf files, plugins and
    ConfigStore (state), and with Hydra's node the working folder it records (hydra.runtime.cwd)."""
    import os

    return (tuple(overrides), with_hydra, os.getcwd() if with_hydra else None, state)


def _composed_without_hydra(overrides: list[str], with_hydra: bool, state: tuple) -> DictConfig | None:
    """The memo's copy, or the value overrides laid over the memoized (or now composed) group
    choices; None: Hydra composes it. A refusal is raised as its ConfigError."""
    from parallel_lab.config.memo import apply_value_overrides, split_value_overrides

    kept = _MEMO.get(_memo_key(overrides, with_hydra, state))
    if isinstance(kept, str):
        raise ConfigError(kept)
    if kept is not None or with_hydra:  # Hydra's node records the overrides: composed whole
        return kept
    try:
        split = split_value_overrides(overrides, _is_group(state))
    except Exception as exc:  # a syntax error: Hydra's own words
        raise ConfigError(describe_compose_error(exc)) from None
    if split is None or not split[1]:
        return None
    groups, values = split
    base = _composed_without_hydra(groups, False, state) or _hydra_compose([groups], False, state)[0]
    if isinstance(base, ConfigError):
        raise base
    try:
        return apply_value_overrides(base, values)
    except Exception as exc:  # every Hydra/OmegaConf error becomes one line
        raise ConfigError(describe_compose_error(exc)) from None


def run_config_over_groups(
    compose_groups, config_name: str, overrides: list[str], loader_key: tuple
) -> DictConfig | None:
    """config/memo.py run_config_over_groups with this process's memo; loader_key: what else
    decides Hydra's composition for a run (its search path, job name, working folder)."""
    from parallel_lab.config.memo import run_config_over_groups as over_groups

    state = register_configs()
    key = ("run", config_name, *loader_key, state)
    return over_groups(_MEMO, key, compose_groups, overrides, _is_group(state))


def _is_group(state: tuple):
    """Hydra's repository's group_exists for a key without '/' and not ``hydra``, for this state of
    the files: a folder of conf/ or a ConfigStore group (strategy_options, the plugins' groups)."""
    from hydra.core.config_store import ConfigStore

    from parallel_lab.config.memo import group_folders_check

    if _MEMO.groups.get("state") != state:
        store = [name for name, node in ConfigStore.instance().repo.items() if isinstance(node, dict)]
        _MEMO.groups.update(state=state, is_group=group_folders_check([CONF_DIR], store))
    return _MEMO.groups["is_group"]


def _hydra_compose(overrides_list: list[list[str]], with_hydra: bool, state: tuple) -> list[DictConfig | ConfigError]:
    """Hydra's compose of each list in one context. Each result (or refusal) is memoized with
    Hydra's node and without it (what compose does without return_hydra_config: the same
    composition, its ``hydra`` deleted), so the command line's mode and its config are one compose."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    out: list[DictConfig | ConfigError] = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides in overrides_list:
            keys = _memo_key(overrides, True, state), _memo_key(overrides, False, state)
            try:
                cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            except Exception as exc:  # every Hydra/OmegaConf error becomes one line
                out.append(ConfigError(describe_compose_error(exc)))
                for key in keys:
                    _MEMO.put(key, str(out[-1]))
                continue
            _MEMO.put(keys[0], cfg)
            bare = _MEMO.copy(cfg) if with_hydra else cfg
            with open_dict(bare):
                del bare["hydra"]
            _MEMO.put(keys[1], bare)
            out.append(cfg)
    return out


def compose_each_strategy(
    overrides: list[str], names: list[str], composed: DictConfig | None = None
) -> list[DictConfig | ConfigError]:
    """``compose_configs([[*overrides, f"strategy={name}"] for name in names])`` with one Hydra
    compose: each name's ``strategy`` node is laid over the others' composition by hand, as Hydra's
    defaults list lays conf/strategy/<name>.yaml (its Options dataclass, then the file's keys). The
    recommender asks this for every strategy, ~0.2 s of CPU a Hydra compose. Overrides of
    ``strategy.*``, or a yaml of another shape (a package directive, other defaults, a plugin's),
    are composed by Hydra. composed: what compose_config(overrides) gave, where the caller has it."""
    import pickle

    each = [[*overrides, f"strategy={name}"] for name in names]
    nodes = [None if _touches_strategy(overrides) else _strategy_node(name) for name in names]
    wanted = any(node is not None for node in nodes)
    (base,) = [composed] if composed is not None else compose_configs([overrides]) if wanted else [None]
    out: list[DictConfig | ConfigError] = []
    for node, one in zip(nodes, each):
        if node is None or isinstance(base, ConfigError):
            out.extend(compose_configs([one]))
            continue
        cfg = pickle.loads(pickle.dumps(base))
        cfg.strategy = node
        out.append(cfg)
    return out


def _touches_strategy(overrides: list[str]) -> bool:
    return any(o.lstrip("+~").split("=")[0].split(".")[0].split("@")[0] in ("strategy", "hydra") for o in overrides)


def _strategy_node(name: str) -> DictConfig | None:
    """conf/strategy/<name>.yaml over its Options as Hydra composes it; None: not that plain shape."""
    from omegaconf import OmegaConf

    from parallel_lab.strategies import options_schemas

    path = CONF_DIR / "strategy" / f"{name}.yaml"
    schemas = options_schemas()
    if not path.is_file() or name not in schemas or "@package" in path.read_text():
        return None
    node = OmegaConf.load(path)
    if list(node.pop("defaults", [])) != [f"/strategy_options/{name}@_here_"]:
        return None
    return OmegaConf.merge(OmegaConf.structured(schemas[name]), node)


# The module's state (allowed in tests/unit/test_module_state.py): what register_configs last stored
# in Hydra's ConfigStore (itself one per process; storing the same again is skipped), and the
# compositions of this process (config/memo.py; each key names all that decides its result).
_stored: dict[str, tuple] = {}
_MEMO = Memo()


def register_configs() -> tuple:
    """Register what the yaml files extend (the root ``Config``, every strategy's Options), the
    configs of plugins (``PARALLEL_LAB_PLUGINS``) and the resolvers the yaml files use. Returns
    the state compositions depend on: a digest of conf/ and the plugins' yaml files, the
    variable, and which registration of the ConfigStore this is."""
    import os

    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from parallel_lab.plugins import PLUGINS_ENV, plugin_config_files
    from parallel_lab.strategies import options_schemas, sweep_names

    schemas = options_schemas()
    plugin_files = {group: plugin_config_files(group) for group in CONFIG_GROUPS}
    plugins = files_digest([], [path for files in plugin_files.values() for path in files.values()])
    if _stored.get("configs") != (schemas, plugin_files, plugins):  # storing converts every dataclass again: ~0.2 s
        store = ConfigStore.instance()
        store.store(name="base_config", node=Config)
        for name, options in schemas.items():
            store.store(group="strategy_options", name=name, node=options)
        for group, files in plugin_files.items():
            for name, path in files.items():
                store.store(group=group, name=name, node=OmegaConf.load(path))
        _stored["configs"] = (schemas, plugin_files, plugins)
        _stored["generation"] = (_stored.get("generation", (0,))[0] + 1,)
    if not OmegaConf.has_resolver("parallel_lab_strategies"):  # conf/experiment/compare_all.yaml
        OmegaConf.register_new_resolver("parallel_lab_strategies", lambda: ",".join(sweep_names()))
    if not OmegaConf.has_resolver("parallel_lab_choices"):  # --help (conf/config.yaml: hydra.help)
        OmegaConf.register_new_resolver("parallel_lab_choices", choices_text)
    return files_digest([CONF_DIR]), os.environ.get(PLUGINS_ENV, ""), _stored["generation"]


def choices_text() -> str:
    """'group: name, name, ...' for every group the command line picks from (schemas left out), and
    the GPU profiles ``plan.hardware=<name>`` picks (conf/hardware/)."""
    groups = [(group, group) for group in (*CONFIG_GROUPS, "experiment")] + [(f"plan.{HARDWARE}", HARDWARE)]
    return "\n".join(f"{label}: {', '.join(available_options(group))}" for label, group in groups)
