"""The spine, in-process: registry <-> yaml, Hydra compose and the parent's validation (threads,
unknown options). Its runs: tests/integration/test_spine.py."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from parallel_lab.config import CONF_DIR, validate
from parallel_lab.strategies import registered_names
from tests.support.cli import compose_cfg


def test_registry_matches_strategy_yaml_files():
    yaml_names = sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))
    assert registered_names() == yaml_names


def test_compose_defaults_and_single_forces_one_process_with_same_total_threads():
    cfg = compose_cfg()
    assert (cfg.strategy.name, cfg.world_size, cfg.model.name, cfg.data.name, cfg.launcher.name) == (
        "ddp",
        2,
        "cnn",
        "synthetic",
        "spawn",
    )
    single = validate(compose_cfg("strategy=single", "world_size=2"))
    assert single.world_size == 1 and single.trainer.threads == 2
    ddp = validate(compose_cfg("strategy=ddp", "world_size=2"))
    assert ddp.world_size == 2 and ddp.trainer.threads == 1


def test_explicit_threads_are_used_as_given():
    assert validate(compose_cfg("strategy=single", "world_size=2", "trainer.threads=3")).trainer.threads == 3
    assert validate(compose_cfg("strategy=ddp", "trainer.threads_per_rank=2", "trainer.threads=1")).trainer.threads == 1
    assert validate(compose_cfg("strategy=ddp", "trainer.threads_per_rank=2")).trainer.threads == 2


def test_compose_rejects_unknown_strategy_option():
    from parallel_lab.errors import ConfigError

    cfg = compose_cfg("strategy=ddp", "+strategy.bucket_cap=3")
    with pytest.raises(ConfigError, match="bucket_cap"):
        validate(cfg)


def test_typed_choices_reach_config_yaml_as_the_strings_users_type(tmp_path):
    """A Choice-typed key (choices.py) is written to config.yaml by member name and read back
    by the workers as a plain string: every member's name must be its value."""
    from omegaconf import OmegaConf

    from parallel_lab.choices import Choice
    from parallel_lab.strategies import options_schemas

    options_schemas()  # imports every strategy, and with it the choices of its Options
    members = [(m.name, m.value) for choice in Choice.__subclasses__() for m in choice]
    assert len(members) > 20 and all(name == value for name, value in members), members
    cfg = compose_cfg("strategy=pp", "strategy.schedule=1f1b", "fault.mode=kill", "trainer.optimizer=sgd")
    OmegaConf.save(cfg, tmp_path / "config.yaml", resolve=True)
    read = OmegaConf.load(tmp_path / "config.yaml")
    typed = (read.strategy.schedule, read.fault.mode, read.trainer.optimizer, read.device)
    assert typed == ("1f1b", "kill", "sgd", "auto") and all(type(v) is str for v in typed), typed


@pytest.mark.parametrize(
    "argv",
    [
        ["+experiment=compare_all"],
        ["-m", "strategy=ddp,fsdp"],
        ["hydra.mode=MULTIRUN"],
        ["+experiment=compare_all", "hydra.run.dir=/tmp/x", "hydra.mode=RUN", "trainer.steps=2"],
        ["hydra.run.dir=/tmp/x", "trainer.steps=2"],
        ["hydra/launcher=basic"],
    ],
    ids=["experiment-sets-multirun", "unset", "hydra-override", "hydra-values", "run-dir", "hydra-group"],
)
def test_the_mode_handed_to_hydra_is_the_one_hydra_composes(argv):
    """The command line hands Hydra the hydra.mode that check_overrides_compose composed, instead of
    Hydra composing the whole config once more to read it (cli/main.py hydra_mode_known). Reference:
    Hydra's own get_mode on the same overrides. A plain hydra.* value (hydra.run.dir, as every test's
    run has) leaves it known; a hydra/ group must leave Hydra to ask itself."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from parallel_lab.config import CONF_DIR, check_overrides_compose, register_configs

    checked = check_overrides_compose(argv)
    register_configs()
    overrides = [a for a in argv if not a.startswith("-")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydras_own = GlobalHydra.instance().hydra.get_mode(config_name="config", overrides=overrides)
    assert checked.mode_known == ("hydra/launcher=basic" not in argv)  # a hydra/ group: Hydra asks itself
    if checked.mode_known:
        assert checked.mode == hydras_own, (checked, hydras_own)


def test_a_sweep_composes_each_jobs_config_once_and_runs_the_same_jobs(tmp_path, monkeypatch):
    """cli/main.py sweep_configs_composed_once: the launcher takes the config Hydra's batch check
    composed instead of composing it again. Reference: the same multirun under Hydra alone (a
    no-op job): the same configs, job numbers and folders, one composition fewer per job (a
    repeated point included)."""
    import sys

    import hydra
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from parallel_lab.cli.main import sweep_configs_composed_once
    from parallel_lab.config import CONF_DIR, register_configs

    register_configs()
    compose = ConfigLoaderImpl.load_configuration

    def run(kept: bool) -> tuple[int, list]:
        counts, jobs = [0], []

        def counting(self, *args, **kwargs):
            counts[0] += 1
            return compose(self, *args, **kwargs)

        @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
        def job(cfg) -> None:
            h = HydraConfig.get()
            jobs.append((OmegaConf.to_yaml(cfg), h.job.num, Path(h.runtime.output_dir).name))

        sweep = tmp_path / ("kept" if kept else "hydra")
        argv = ["x", "--multirun", "strategy=ddp,ddp,single", "trainer.steps=3", f"hydra.sweep.dir={sweep}"]
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counting)
        with sweep_configs_composed_once() if kept else contextlib.nullcontext():
            job()
        return counts[0], jobs

    hydras, reference = run(kept=False)
    ours, jobs = run(kept=True)
    assert jobs == reference and len(jobs) == 3, (jobs, reference)
    assert ours == hydras - 3, (ours, hydras)
