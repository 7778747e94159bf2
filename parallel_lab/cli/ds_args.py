"""DeepSpeed's command-line conventions, accepted wherever a DeepSpeed user would type them.

``deepspeed.add_config_arguments`` gives every DeepSpeed script ``--deepspeed`` (use DeepSpeed),
``--deepspeed_config <file>`` (the JSON config) and the deprecated ``--deepscale`` /
``--deepscale_config``; the ``deepspeed`` launcher adds ``--local_rank=N``. Here they become Hydra
overrides: ``--deepspeed_config F`` is ``strategy.ds_config=F``, and with no ``strategy=`` on the
command line the strategy is ``zero<stage>`` of the file's ``zero_optimization.stage`` (DeepSpeed's
default stage is 0), which is what DeepSpeed itself would run. ``--local_rank`` is the rank's
business (the worker reads it); the parent drops it. The flags are declared here, not imported
from DeepSpeed, so the parent of a non-DeepSpeed run never imports it; a test checks they match.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.zero import STAGES, zero_name, zero_stage


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The same flags as ``deepspeed.add_config_arguments`` (names, dest, type, default)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="use DeepSpeed (a zero<N> strategy)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return add_deepspeed_arguments(parser)


def _file_stage(path: str) -> int:
    """zero_optimization.stage of a DeepSpeed JSON file (0 when absent, as in DeepSpeed)."""
    try:
        zero = json.loads(Path(path).expanduser().read_text()).get("zero_optimization") or {}
        return int(zero.get("stage", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0  # unreadable here: strategy.ds_config's own checks name the problem


def split_deepspeed_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(DeepSpeed's flags, every other argument in order)."""
    return _parser().parse_known_args(argv)


def overrides_from_deepspeed_args(argv: list[str]) -> list[str]:
    """argv with DeepSpeed's flags turned into Hydra overrides (a ConfigError where they contradict
    an override on the same command line)."""
    args, rest = split_deepspeed_args(argv)
    config = args.deepspeed_config or args.deepscale_config
    use_ds = args.deepspeed or args.deepscale or config is not None
    if not use_ds:
        return rest
    keys = {a.partition("=")[0].lstrip("+~"): a.partition("=")[2] for a in rest if "=" in a}
    strategy = keys.get("strategy")
    if strategy is not None and zero_stage(strategy) is None:
        stages = f"{zero_name(STAGES[0])}..{zero_name(STAGES[-1])}"
        raise ConfigError(
            f"--deepspeed contradicts strategy={strategy}; drop strategy= (the stage then comes from "
            f"zero_optimization.stage of --deepspeed_config) or use strategy={stages}"
        )
    added = []
    if strategy is None:
        added.append(f"strategy={zero_name(_file_stage(config) if config else 0)}")
    if config is not None:
        given = keys.get("strategy.ds_config")
        if given is not None and Path(given).expanduser().resolve() != Path(config).expanduser().resolve():
            raise ConfigError(f"--deepspeed_config {config} contradicts strategy.ds_config={given}; pass the file once")
        if given is None:
            added.append(f"strategy.ds_config={config}")
    return [*added, *rest]
