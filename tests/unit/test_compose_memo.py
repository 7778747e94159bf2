"""config/memo.py: compose_config gives exactly Hydra's own compose (the config, its node types and
flags, or the refusal's line word for word) whether it composed, took the memo's copy or laid value
overrides over the group choices' composition; a copy is the caller's own; and no change to a yaml
file or to PARALLEL_LAB_PLUGINS between two composes is missed."""

from __future__ import annotations

import contextlib
import sys

import pytest
from omegaconf import DictConfig, OmegaConf, open_dict

# Value overrides of every kind Hydra parses (add, force-add, delete, lists, null, quoted, an
# interpolation, a dict), beside group choices, plugin-free and plain, good and bad.
OVERRIDES = [
    [],
    ["trainer.steps=3"],
    ["model=gpt", "trainer.steps=2", "trainer.lr=1e-3", "world_size=4"],
    ["trainer.steps=2", "model=gpt"],  # the group choice after the value: the same as before it
    ["strategy=fsdp", "strategy.sharding=full", "trainer.betas=[0.8,0.9]", "data.size=null"],
    ["++trainer.steps=5", "~trainer.threads", "trainer.checkpoint_dir='a b/c'"],
    ["trainer.steps=${world_size}", "world_size=3"],
    ["trainer.lr_scheduler_params={gamma:0.5}", "launcher=torchrun", "launcher.hosts=[node0,node1]"],
    ["plan.hardware=h100_sxm", "plan.hardware.inter_node_gbps=800"],
    ["+experiment=compare_all", "trainer.steps=4"],
    # refusals
    ["trainer.stesp=3"],
    ["+trainer.brand_new=1"],
    ["trainer.steps=ten"],
    ["trainer.steps=3,4"],
    ["trainer.steps=[1"],
    ["~trainer.nothing"],
    ["world_size=2", "strategy.nope=1", "model=gpt"],
    ["model@trainer=gpt"],
    ["hydra.job.name=x", "trainer.steps=2"],
]


def hydras_compose(cases: list[list[str]]) -> list[str]:
    """Reference: Hydra's compose API on its own (one context), as compose_config called it before
    the memo: each config's yaml with its nodes' types and flags, or the refusal's line."""
    from hydra import compose, initialize_config_dir

    from parallel_lab.config.compose import (
        CONF_DIR,
        check_group_overrides,
        describe_compose_error,
        hardware_overrides,
        register_configs,
    )
    from parallel_lab.errors import ConfigError

    register_configs()
    out = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides in cases:
            try:
                check_group_overrides(overrides)
                out.append(shape(compose(config_name="config", overrides=hardware_overrides(overrides))))
            except ConfigError as exc:
                out.append(f"refused: {exc}")
            except Exception as exc:
                out.append(f"refused: {describe_compose_error(exc)}")
    return out


def shape(cfg: DictConfig) -> str:
    """The yaml, and every node's key, type, object type and flags: what a config is, not only its values."""
    lines = [OmegaConf.to_yaml(cfg)]
    pending = [("", cfg)]
    while pending:
        key, node = pending.pop()
        meta = node._metadata
        lines.append(f"{key} {type(node).__name__} {meta.object_type} {meta.ref_type} {sorted(meta.flags.items())}")
        if OmegaConf.is_dict(node) or OmegaConf.is_list(node):
            children = node.items_ex(resolve=False) if OmegaConf.is_dict(node) else enumerate(node)
            pending.extend((f"{key}.{k}", node._get_node(k)) for k, _ in children)
    return "\n".join(lines)


def ours(overrides: list[str]) -> str:
    from parallel_lab.config import compose_config
    from parallel_lab.errors import ConfigError

    try:
        return shape(compose_config(overrides))
    except ConfigError as exc:
        return f"refused: {exc}"


def catalogue_overrides(ids: tuple[str, ...] | None = None) -> list[list[str]]:
    """The bad-input catalogue's fixed override lists (tests/integration/test_failures.py), or those of ids."""
    from tests.integration.test_failures import CATALOGUE

    lists = {case: list(o) for case, (o, _) in CATALOGUE.items() if isinstance(o, list)}
    return list(lists.values()) if ids is None else [lists[case] for case in ids]


# The catalogue's refusals Hydra's compose words (a key, a type, a choice, the syntax); the rest of
# the catalogue composes and is refused later, by validate (its overrides' split is checked below).
COMPOSE_REFUSALS = (
    "unknown-key", "wrong-type-int", "wrong-type-float", "override-syntax", "precision-unknown",
    "single-precision-unknown", "zero-offload-unknown", "pp-schedule-unknown", "device", "fault-at",
    "deepspeed-flag-vs-strategy", "unknown-model",
)  # fmt: skip


def test_compose_config_is_hydras_compose_over_value_overrides_and_refusals():
    refusals = catalogue_overrides(COMPOSE_REFUSALS)
    wanted = hydras_compose(OVERRIDES + refusals)
    assert all(w.startswith("refused: ") for w in wanted[len(OVERRIDES) :])
    assert sum(w.startswith("refused: ") for w in wanted[: len(OVERRIDES)]) >= 8
    for case, want in zip(OVERRIDES + refusals, wanted):
        assert ours(case) == want, case
        assert ours(case) == want, f"{case}: the memo's copy"


def test_every_override_is_split_as_hydras_own_repository_sees_it():
    """Hydra applies an override to the composed config exactly where its repository has no group
    of that name (defaults_list.Overrides); config/memo.py splits them the same way, without a
    Hydra context, for every override here and in the whole catalogue."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from parallel_lab.config.compose import CONF_DIR, _is_group, hardware_overrides, register_configs

    parser = OverridesParser.create()
    keys = set()
    for case in OVERRIDES + catalogue_overrides():
        for text in hardware_overrides([o for o in case if not o.startswith("-")]):
            with contextlib.suppress(HydraException):  # a syntax error: refused before any split
                keys.add(parser.parse_override(text).key_or_group)
    keys = {key for key in keys if "/" not in key and not key.startswith("hydra")}
    is_group = _is_group(register_configs())
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        repository = GlobalHydra.instance().hydra.config_loader.repository
        hydras = {key for key in keys if repository.group_exists(key)}
    assert {key for key in keys if is_group(key)} == hydras
    assert {"strategy", "model", "launcher", "hardware"} <= hydras and len(keys - hydras) > 20


def test_a_copy_is_the_callers_own():
    from parallel_lab.config import compose_config

    compose_config(["model=gpt", "trainer.steps=2"])  # composed: the next two are the memo's
    first = compose_config(["model=gpt", "trainer.steps=2"])
    first.trainer.steps, first.model.name = 99, "changed"
    with open_dict(first):
        del first["plan"]
    again = compose_config(["model=gpt", "trainer.steps=2"])
    assert (again.trainer.steps, again.model.name, "plan" in again) == (2, "gpt", True)


def test_the_mode_is_hydras_where_value_overrides_are_left_out():
    """check_overrides_compose reads hydra.mode from the group choices' composition."""
    from parallel_lab.config import compose_config
    from parallel_lab.config.compose import group_choices

    for overrides in (["+experiment=compare_all", "trainer.steps=4"], ["trainer.steps=4", "model=gpt"]):
        whole = compose_config(overrides, with_hydra=True).hydra.mode
        assert compose_config(group_choices(overrides), with_hydra=True).hydra.mode == whole
    assert group_choices(["trainer.steps=4", "model=gpt", "plan.hardware=h100_sxm"]) == [
        "model=gpt",
        "plan.hardware=h100_sxm",
    ]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A plugin module whose conf/model/probe.yaml the test edits between composes."""
    package = tmp_path / "memo_probe_plugin"
    (package / "conf" / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PARALLEL_LAB_PLUGINS", "memo_probe_plugin")
    yield package / "conf" / "model" / "probe.yaml"
    sys.modules.pop("memo_probe_plugin", None)


def test_an_edited_yaml_or_plugins_variable_is_seen_at_the_next_compose(plugin, monkeypatch):
    from parallel_lab.config import compose_config
    from parallel_lab.errors import ConfigError

    plugin.write_text("name: cnn\nnum_classes: 10\n")
    assert compose_config(["model=probe", "trainer.steps=2"]).model.num_classes == 10
    plugin.write_text("name: cnn\nnum_classes: 12\n")  # the same size, maybe the same timestamp
    assert compose_config(["model=probe", "trainer.steps=2"]).model.num_classes == 12
    assert compose_config(["model=probe"]).model.num_classes == 12
    monkeypatch.delenv("PARALLEL_LAB_PLUGINS")
    with pytest.raises(ConfigError, match="unknown model 'probe'"):
        compose_config(["model=probe", "trainer.steps=2"])


def test_the_digest_sees_a_same_size_edit_and_a_new_file(tmp_path):
    from parallel_lab.config.memo import files_digest

    (tmp_path / "a.yaml").write_text("x: 1\n")
    before = files_digest([tmp_path])
    (tmp_path / "a.yaml").write_text("x: 2\n")
    edited = files_digest([tmp_path])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("")
    assert len({before, edited, files_digest([tmp_path])}) == 3


def test_a_runs_config_over_kept_groups_is_hydras_own(tmp_path, monkeypatch):
    """cli/main.py run_config_over_kept_groups: each run's config (and Hydra's node: the overrides
    it records, override_dirname, the job's name) is the one hydra.main composes itself, with no
    composition of its own once the group choices were composed in this process."""
    import hydra
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from parallel_lab.cli.main import run_config_over_kept_groups
    from parallel_lab.config import CONF_DIR, register_configs

    register_configs()
    compose, seen, runs = ConfigLoaderImpl.load_configuration, [], []

    def counting(self, config_name, overrides, run_mode, *args, **kwargs):
        runs.append(run_mode == RunMode.RUN)
        return compose(self, config_name, overrides, run_mode, *args, **kwargs)

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> None:
        seen.append(OmegaConf.to_yaml(cfg) + OmegaConf.to_yaml(HydraConfig.get()))

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counting)
    for number, argv in enumerate(
        (
            ["trainer.steps=3", "model=gpt", "trainer.lr=1e-3"],
            ["model=gpt", "hydra.job.name=probe", "trainer.steps=4", "hydra.verbose=true"],
            [
                "++world_size=3",
                "strategy=fsdp",
                "+trainer.lr_scheduler_params.gamma=0.5",
                "hydra.job.config.override_dirname.kv_sep=:",
            ],
        )
    ):
        monkeypatch.setattr(sys, "argv", ["x", *argv, f"hydra.run.dir={tmp_path / str(number)}"])
        job()  # Hydra alone
        for _ in range(2):  # the groups composed by Hydra's loader, then taken from the memo
            runs.clear()
            with run_config_over_kept_groups():
                job()
        assert seen[-1] == seen[-2] == seen[-3], argv
        assert runs == [False], "the run's composition was not taken from the kept groups"
