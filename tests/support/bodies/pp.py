"""Distributed test bodies for pipeline parallelism (run with parallel_lab.cli.run.run_ranks by
tests/integration/test_pipeline_parallel.py)."""

from __future__ import annotations

from tests.support.matrix import each_configuration


def strategy_matrix_body(
    rank: int, world_size: int, configs: dict[str, list[str]], steps: int, global_batch: int
) -> None:
    """Each configuration trains through the real loop with stages = world_size; losses, gathered
    parameters and eval accuracy must match the single-process reference, each rank must hold only
    its own stage, and the manual schedules must stash what GPipe / 1F1B promise. Prints each
    configuration's result on this rank (tests/support/matrix.py)."""

    def holds_its_stage_and_keeps_its_schedule(overrides, metrics, strategy, ref) -> None:
        full_bytes = 4 * sum(p.numel() for p in ref.params.values())
        held = [r["param_bytes"] for r in metrics.ranks]
        assert sum(held) == full_bytes and max(held) < full_bytes, (
            f"{overrides}: per-rank param bytes {held}, full {full_bytes}"
        )
        assert held[rank] == 4 * sum(p.numel() for p in strategy.model.parameters())
        m, p = strategy.opts.microbatches, world_size
        idle = metrics.strategy_extras["pp_idle_fraction"]
        assert len(idle) == p and all(0.0 <= f <= 1.0 for f in idle), f"{overrides}: idle fractions {idle}"
        if strategy.opts.impl == "manual":
            from parallel_lab.strategies.pp.schedules import peak_in_flight, rank_orders

            orders = rank_orders(str(strategy.opts.schedule), m, p, strategy.opts.virtual_stages)
            expected = [peak_in_flight(order, [1] * strategy.opts.virtual_stages) for order in orders]
            if strategy.opts.virtual_stages == 1:  # the schedules' promise, not only the order's count
                assert expected == [m if strategy.opts.schedule == "gpipe" else min(p - s, m) for s in range(p)]
            inflight = metrics.strategy_extras["pp_max_inflight_microbatches"]
            assert inflight == expected, f"{overrides}: stashed micro-batches {inflight}, schedule promises {expected}"

    base = ["strategy=pp", f"world_size={world_size}", f"strategy.stages={world_size}"]
    each_configuration(configs, steps, global_batch, base, holds_its_stage_and_keeps_its_schedule)
