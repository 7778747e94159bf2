"""``python -m parallel_lab [overrides]`` (also the ``parallel-lab`` command).

Hydra runs here, in the parent only: compose and validate the config, write the resolved
``<run_dir>/config.yaml``, start the workers through the chosen launcher, wait, summarise.
With ``--multirun`` each sweep point is one such run, and the report is written at the end.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from parallel_lab.config import (
    CONF_DIR,
    check_group_overrides,
    check_overrides_compose,
    register_configs,
    validate,
    write_run_config,
)
from parallel_lab.errors import ConfigError, one_line
from parallel_lab.protocol import FAILED_FILE, METRICS_FILE, FailedRun

log = logging.getLogger("parallel_lab")
_exit_codes: list[int] = []  # one per run of this invocation (a sweep goes on past failures)


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


def run_one(cfg: DictConfig, run_dir: Path) -> int:
    """Validate, write config.yaml, launch, and check the workers left metrics.json."""
    from parallel_lab.cli.launch import first_failure, launch

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        cfg = validate(cfg, run_dir)
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


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    _exit_codes.append(run_one(cfg, Path(HydraConfig.get().runtime.output_dir)))


def main() -> None:
    try:
        check_group_overrides(sys.argv[1:])
        check_overrides_compose(sys.argv[1:])
    except ConfigError as exc:
        print(f"parallel_lab: error: {exc}", file=sys.stderr)
        sys.exit(2)
    register_configs()
    hydra_main()
    from parallel_lab.report.sweep import failed_proofs

    for line in failed_proofs:
        print(f"parallel_lab: error: parity not proven for {line}", file=sys.stderr)
    sys.exit(next((code for code in _exit_codes if code), 1 if failed_proofs else 0))


if __name__ == "__main__":
    main()
