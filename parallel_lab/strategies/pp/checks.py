"""``pp``'s option checks that stand beside the schedule's (``rules.py`` ``check_schedule``): the
split inside each stage (tensor parallelism, ``check_pp_tp``) and balance=time's block times
(``check_balance``). Torch-free at import (the parent refuses bad input before torch is imported)."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.pp.cuts import config_blocks


def check_pp_tp(opts: DictConfig, cfg: DictConfig) -> None:
    """tp > 1 inside the stages: the vit under the manual loop only; the split's own rules."""
    tp, sp = opts.get("tp", 1), bool(opts.get("sequence_parallel"))
    if tp < 1:
        raise ConfigError(f"strategy.tp={tp} must be >= 1 (1 = no tensor parallelism); e.g. strategy.tp=2")
    if sp and tp < 2:
        raise ConfigError(
            f"strategy.sequence_parallel=true needs strategy.tp > 1 (got strategy.tp={tp}); "
            "use strategy.tp=2 or strategy.sequence_parallel=false"
        )
    if tp == 1:
        return
    if cfg.model.name != "vit":
        # the gpt has blocks, but its vocabulary-parallel ends (tp/vocab.py) sit on the first and last
        # stages, which the manual pipeline loop does not split
        has = "is split so only outside a pipeline (strategy=tp)" if cfg.model.name == "gpt" else "has none"
        raise ConfigError(
            f"strategy.tp={tp} inside pipeline stages splits the vit's transformer blocks (Megatron), "
            f"model={cfg.model.name} {has}; use model=vit or strategy.tp=1"
        )
    if str(opts.impl) != "manual":
        raise ConfigError(
            f"strategy.tp={tp} with strategy.impl={opts.impl}: only the manual pipeline loop sends to the same "
            "tp coordinate of the next stage; use strategy.impl=manual or strategy.tp=1"
        )
    from parallel_lab.strategies.tp.rules import check_vit_split

    check_vit_split(cfg, tp, sp, "manual")


def check_balance(opts: DictConfig, cfg: DictConfig) -> None:
    """balance=time: measure each block here, once, in the parent (pp/timing.py); times given
    by hand must name every block."""
    blocks = len(config_blocks(cfg))  # torch-free: the meta model's (models/layout.py)
    if opts.block_times and str(opts.balance) != "time":
        raise ConfigError(
            f"strategy.block_times is for strategy.balance=time (balance={opts.balance}); drop strategy.block_times"
        )
    if str(opts.balance) == "time" and not opts.cuts:
        if not opts.block_times:
            from parallel_lab.strategies.pp.timing import measure_block_times

            opts.block_times = measure_block_times(cfg)
        if len(opts.block_times) != blocks or min(opts.block_times) <= 0:
            raise ConfigError(
                f"strategy.block_times={list(opts.block_times)} must hold {blocks} positive seconds, one per block; "
                "drop it to measure them (strategy.balance=time)"
            )
