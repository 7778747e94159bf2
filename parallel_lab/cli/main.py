"""``python -m parallel_lab [overrides]`` (also the ``parallel-lab`` command).

Hydra runs here, in the parent only: compose and validate the config, write the resolved
``<run_dir>/config.yaml``, start the workers through the chosen launcher, wait, summarise.
With ``--multirun`` each sweep point is one such run; then ``cli/sweep.py`` adds the noise floor and
writes the report, and hands back the rows whose proof failed (they set the exit code).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parallel_lab.cli.help import help_text
from parallel_lab.config import (
    CONF_DIR,
    Checked,
    check_group_overrides,
    check_overrides_compose,
    register_configs,
    run_config_over_groups,
    validate,
    write_run_config,
)
from parallel_lab.errors import ConfigError, one_line
from parallel_lab.protocol import FAILED_FILE, METRICS_FILE, FailedRun

log = logging.getLogger("parallel_lab")


def _fail(run_dir: Path, cfg: DictConfig, message: str, traceback_text: str = "") -> None:
    """Record a failed run: failed.json (never metrics.json) and one line on stderr."""
    FailedRun(
        strategy=OmegaConf.select(cfg, "strategy.name"),
        launcher=OmegaConf.select(cfg, "launcher.name"),
        world_size=OmegaConf.select(cfg, "world_size"),
        model=OmegaConf.select(cfg, "model.name"),
        error=message,
    ).write(run_dir / FAILED_FILE)
    if traceback_text:
        print(traceback_text, file=sys.stderr, end="" if traceback_text.endswith("\n") else "\n")
    print(f"parallel_lab: error: {message}", file=sys.stderr, flush=True)


def run_one(cfg: DictConfig, run_dir: Path, reach_hosts: bool = True) -> int:
    """Validate, write config.yaml, launch, and check the workers left metrics.json. reach_hosts:
    probe the hosts (False where the command line already did, before Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    from parallel_lab.cli.launch import first_failure, launch

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        # The command line's overrides (a ds_config file yields to none of them silently); a noise-floor
        # rerun (cli/sweep.py) starts from a resolved config.yaml, outside any Hydra job.
        explicit = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        cfg = validate(cfg, run_dir, explicit=explicit, reach_hosts=reach_hosts)
        write_run_config(cfg)
        code = launch(cfg, run_dir)
    except ConfigError as exc:
        _fail(run_dir, cfg, one_line(str(exc)))
        return 2
    if code is None:  # the per-host commands were printed, for the user to start
        return 0
    metrics_path = run_dir / METRICS_FILE
    if code == 0 and metrics_path.is_file():
        from parallel_lab.report.table import summary_line

        print(summary_line(metrics_path), flush=True)
        return 0
    failure = first_failure(run_dir)
    if failure:
        rank, summary, text = failure
        _fail(run_dir, cfg, f"rank {rank} failed: {summary}", text)
    else:
        _fail(run_dir, cfg, f"workers exited with code {code} and wrote no {METRICS_FILE}; see the log above")
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    return code or 1


@dataclass
class Outcome:
    """What one invocation did: each run's exit code (a sweep goes on past failures), the sweep's
    folder when it was a --multirun, and the rows of its report whose proof failed."""

    codes: list[int] = field(default_factory=list)
    sweep_dir: Path | None = None
    failed_proofs: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return next((code for code in self.codes if code), 1 if self.failed_proofs else 0)


def run_hydra(outcome: Outcome, checked: Checked | None = None) -> None:
    """Hydra composes the config from sys.argv and calls the job once per run (once per sweep point
    with --multirun); every job's result goes into ``outcome``. checked: what
    ``check_overrides_compose`` found (None: nothing; the job then validates and probes the hosts)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    reach_hosts = checked is None or not checked.validated

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> None:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            outcome.sweep_dir = Path(hydra_cfg.sweep.dir)
        outcome.codes.append(run_one(cfg, Path(hydra_cfg.runtime.output_dir), reach_hosts))

    with hydra_mode_known(checked), sweep_configs_composed_once(), run_config_over_kept_groups():
        job()


@contextlib.contextmanager
def run_config_over_kept_groups():
    """Hydra composes each run's config whole (~0.2 s of CPU), though the parent's check and the
    runs before it in this process (a test session's) composed the same group choices. Here a run's
    composition (RUN mode) is the group choices' one, composed once per process by Hydra's own
    loader, with the value overrides laid over it (config/memo.py run_config_over_groups);
    any other shape of overrides, and a sweep's master config, Hydra composes itself."""
    import os

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.utils import JobRuntime
    from hydra.types import RunMode

    compose = ConfigLoaderImpl.load_configuration

    def load_configuration(self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        def whole(some: list[str]) -> DictConfig:
            return compose(self, config_name, some, run_mode, from_shell, validate_sweep_overrides)

        if run_mode != RunMode.RUN or config_name is None:
            return whole(overrides)
        job = JobRuntime().get("name")
        loader = (str(self.config_search_path), from_shell, validate_sweep_overrides, os.getcwd(), job)
        return run_config_over_groups(whole, config_name, list(overrides), loader) or whole(overrides)

    ConfigLoaderImpl.load_configuration = load_configuration
    try:
        yield
    finally:
        ConfigLoaderImpl.load_configuration = compose


@contextlib.contextmanager
def sweep_configs_composed_once():
    """Hydra's BasicSweeper composes every job's config to check the batch before any job runs
    (``Sweeper.validate_batch_is_legal``), then its BasicLauncher, in this same process, composes
    each again to run it: two compositions a job, ~0.1 s of CPU each (the demo's 14 jobs). Here
    each config the check composed is kept, and the launcher's call with the same loader, master
    config and overrides takes it, after the master's resolver cache is copied into it again (the
    last step of Hydra's own ``load_sweep_config``: the same timestamps). Every other call composes."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.plugins.sweeper import Sweeper

    compose, check = ConfigLoaderImpl.load_sweep_config, Sweeper.validate_batch_is_legal
    kept: dict[tuple, list[DictConfig]] = {}  # a batch may hold the same overrides twice
    checking: list[bool] = []

    def validate_batch_is_legal(self, batch) -> None:
        checking.append(True)
        try:
            check(self, batch)
        finally:
            checking.pop()

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        key = (id(self), id(master_config), tuple(sweep_overrides))
        if not checking and kept.get(key):
            cfg = kept[key].pop(0)
            OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
            return cfg
        cfg = compose(self, master_config, sweep_overrides)
        if checking:
            kept.setdefault(key, []).append(cfg)
        return cfg

    ConfigLoaderImpl.load_sweep_config, Sweeper.validate_batch_is_legal = load_sweep_config, validate_batch_is_legal
    try:
        yield
    finally:
        ConfigLoaderImpl.load_sweep_config, Sweeper.validate_batch_is_legal = compose, check


@contextlib.contextmanager
def hydra_mode_known(checked: Checked | None):
    """Hydra composes the whole config once more (``Hydra.get_mode``) only to read ``hydra.mode``,
    before it composes it again for the run: ~0.2 s of CPU a command. ``check_overrides_compose``
    composed it already from the same overrides, so Hydra is handed that answer. Where an override
    of ``hydra`` other than a plain value could change the mode (a hydra/ group, a prefix, an
    interpolation), Hydra asks itself as before."""
    from hydra._internal.hydra import Hydra

    if checked is None or not checked.mode_known:
        yield
        return
    asks_itself = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: checked.mode
    try:
        yield
    finally:
        Hydra.get_mode = asks_itself


def main() -> int:
    """The command line; returns its exit code (2: bad input, before any process started)."""
    if sys.argv[1:2] == ["checkpoint"]:  # parallel-lab checkpoint inspect|export: reads files, no Hydra
        from parallel_lab.checkpoint.__main__ import main as checkpoint_main

        return checkpoint_main(sys.argv[2:])
    try:
        if any(a.startswith(("--deep", "--local")) for a in sys.argv[1:]):  # DeepSpeed's own flags
            from parallel_lab.cli.ds_args import overrides_from_deepspeed_args

            sys.argv[1:] = overrides_from_deepspeed_args(sys.argv[1:])
        check_group_overrides(sys.argv[1:])
        shown = help_text(sys.argv[1:])  # before Hydra is imported: a bare --help never imports it
        if shown is not None:
            print(shown)
            return 0
        checked = check_overrides_compose(sys.argv[1:])  # a single run's hosts probed there
    except ConfigError as exc:
        print(f"parallel_lab: error: {exc}", file=sys.stderr)
        return 2
    register_configs()
    outcome = Outcome()
    run_hydra(outcome, checked)
    if outcome.sweep_dir is not None:
        from parallel_lab.cli.sweep import finish_sweep

        outcome.failed_proofs = finish_sweep(outcome.sweep_dir, run_one)
    for line in outcome.failed_proofs:
        print(f"parallel_lab: error: parity not proven for {line}", file=sys.stderr)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
