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
    check_pass_times(opts, blocks)
    if str(opts.balance) == "time" and not opts.cuts:
        if not opts.block_times:
            from parallel_lab.strategies.pp.timing import measure_pass_times, splits_backward

            opts.block_times, passes = measure_pass_times(cfg)
            if splits_backward(opts) and not opts.pass_times:  # zero bubble's order is built from them
                opts.pass_times = passes
        if len(opts.block_times) != blocks or min(opts.block_times) <= 0:
            raise ConfigError(
                f"strategy.block_times={list(opts.block_times)} must hold {blocks} positive seconds, one per block; "
                "drop it to measure them (strategy.balance=time)"
            )


def check_pass_times(opts: DictConfig, blocks: int) -> None:
    """``strategy.pass_times`` (zero bubble's per-block F, B, W, pp/zb_orders.py): only where the
    manual loop runs zero bubble cut by time, one [F, B, W] of seconds per block, F and B positive."""
    times = [list(t) for t in opts.get("pass_times") or []]
    if not times:
        return
    runs = str(opts.schedule) == "zero_bubble" and str(opts.impl) == "manual" and str(opts.balance) == "time"
    if not runs or opts.cuts:
        raise ConfigError(
            "strategy.pass_times is for strategy.schedule=zero_bubble strategy.impl=manual strategy.balance=time "
            f"without strategy.cuts (schedule={opts.schedule}, impl={opts.impl}, balance={opts.balance}, "
            f"cuts={list(opts.cuts)}); drop strategy.pass_times"
        )
    if len(times) != blocks or any(len(t) != 3 or min(t[:2]) <= 0 or t[2] < 0 for t in times):
        raise ConfigError(
            f"strategy.pass_times={times} must hold {blocks} [F, B, W] seconds, one per block, F and B > 0, "
            "W >= 0; drop it (with strategy.block_times) to measure them"
        )
