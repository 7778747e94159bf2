"""What makes a repeated Hydra compose free: a per-process memo of compositions (memoization, Michie
1968, "Memo functions and machine learning", Nature 218) keyed by everything that decides the
result, and the value overrides (``trainer.steps=3``) laid over a memoized composition of the group
choices alone, as Hydra itself lays them after its defaults tree.

A Hydra compose is ~0.2 s of CPU (the defaults tree, loading and parsing every yaml, parsing the
overrides); a pickle round-trip of its result ~3 ms. The suite composes thousands of configs, most
of them the same few group choices with other values.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override
    from omegaconf import DictConfig

MEMO_SIZE = 256  # compositions kept (10-25 kB pickled each); the oldest used goes first


class Memo:
    """Pickled compositions (or their one-line refusals) by key; each hit is a fresh copy, so a
    caller (or Hydra, which pops ``hydra`` from what it composed) can change what it got."""

    def __init__(self, size: int = MEMO_SIZE) -> None:
        self.size = size
        self.entries: OrderedDict[tuple, bytes | str] = OrderedDict()
        self.groups: dict = {}  # the state of the files and its is_group (compose._is_group)

    def get(self, key: tuple) -> DictConfig | str | None:
        """A copy of the composition (a str: the refusal's line), or None if not kept."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry if isinstance(entry, str) else pickle.loads(entry)

    @staticmethod
    def copy(cfg: DictConfig) -> DictConfig:
        return pickle.loads(pickle.dumps(cfg))

    def put(self, key: tuple, result: DictConfig | str) -> None:
        self.entries[key] = result if isinstance(result, str) else pickle.dumps(result)
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def files_digest(folders: Iterable[Path], files: Iterable[Path] = ()) -> str:
    """A digest of the path and bytes of every file under these folders and of these files (~2 ms
    for conf/): an edited, added or removed yaml changes it, whatever its timestamps say."""
    paths = [os.path.join(root, name) for folder in folders for root, _, names in os.walk(folder) for name in names]
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(paths) + [str(f) for f in files]:
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def split_value_overrides(overrides: list[str], is_group) -> tuple[list[str], list[Override]] | None:
    """(the group choices, the parsed value overrides) where every override that is not a group
    choice is one Hydra applies to the composed config after its defaults tree (``key=value``,
    ``+key=value``, ``~key`` on a key that is no config group, no package, no sweep, not ``hydra.*``);
    None where any is not (Hydra composes those). A syntax error raises Hydra's own exception."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    groups, values = [], []
    for text, override in zip(overrides, parsed):
        key = override.key_or_group
        if override.is_sweep_override() or key.split(".")[0] == "hydra" or "/" in key:
            return None
        if is_group(key):
            if override.is_force_add() or isinstance(override.value(), dict):
                return None  # Hydra's own refusal, or a dict merged into a group's node: Hydra's
            groups.append(text)
        elif override.package is not None:
            return None
        else:
            values.append(override)
    return groups, values


def apply_value_overrides(cfg: DictConfig, values: list[Override]) -> DictConfig:
    """The value overrides applied in order, by the very function Hydra's compose applies them with
    after its defaults tree (``ConfigLoaderImpl._apply_overrides_to_config``, hydra-core 1.3: the
    same errors, word for word; tests/unit/test_compose_memo.py compares the two)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg


def group_folders_check(folders: Iterable[Path], store_groups: Iterable[str]):
    """is_group(key) as Hydra's repository answers it for a key without '/' (Hydra's own
    pkg://hydra.conf holds only ``hydra``, never split): a folder of that name in a config folder or
    a ConfigStore group (tests/unit/test_compose_memo.py asks Hydra's repository itself)."""
    names = set(store_groups)
    for folder in folders:
        names.update(p.name for p in Path(folder).iterdir() if p.is_dir())
    return names.__contains__


def run_config_over_groups(memo: Memo, key: tuple, compose_groups, overrides: list[str], is_group) -> DictConfig | None:
    """Hydra's own composition for a run (``hydra.main``, with its ``hydra`` node) from the
    memoized composition of the group choices alone (``compose_groups(groups)`` composes it with
    the same loader): the value overrides (``hydra.*`` ones too) applied with Hydra's function,
    then Hydra's node's records of them rebuilt as its loader writes them (hydra-core 1.3
    ``_load_configuration_impl``: overrides.task/hydra, env_set, override_dirname). None: an
    override of another shape (a sweep, ``hydra/...`` groups, hydra.searchpath): Hydra composes."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    plain = [o for o in parsed if not o.get_key_element().startswith("hydra.")]
    split = split_value_overrides([o.input_line for o in plain], is_group)
    hydras = [o for o in parsed if o.get_key_element().startswith("hydra.")]
    special = ("hydra.searchpath", "hydra.job.env_")  # they change what the groups' composition recorded
    if split is None or any(o.get_key_element().startswith(special) or o.is_sweep_override() for o in hydras):
        return None
    groups = set(split[0])
    chosen = [o.input_line for o in plain if o.input_line in groups]
    cfg = memo.get((*key, tuple(chosen)))
    if cfg is None:
        cfg = compose_groups(chosen)
        memo.put((*key, tuple(chosen)), cfg)
    apply_value_overrides(cfg, [o for o in parsed if o.input_line not in groups])
    app = [o for o in parsed if not o.is_hydra_override()]
    cfg.hydra.overrides.task = [o.input_line for o in app]
    cfg.hydra.overrides.hydra = [o.input_line for o in parsed if o.is_hydra_override()]
    with open_dict(cfg.hydra):
        for name in cfg.hydra.job.env_copy:
            cfg.hydra.job.env_set[name] = os.environ[name]
    job = cfg.hydra.job.config.override_dirname
    cfg.hydra.job.override_dirname = get_overrides_dirname(
        overrides=app, kv_sep=job.kv_sep, item_sep=job.item_sep, exclude_keys=job.exclude_keys
    )
    return cfg
