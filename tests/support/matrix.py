"""A matrix of configurations trained one after another in ONE set of ranks (one start-up, and one
computation of each reference per rank, instead of one per configuration), reported per
configuration so that each one is its own test id: a module-scoped fixture calls
run_configurations once, and each configuration's test asserts its own result with
assert_every_rank_passed."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable

import torch.distributed as dist

from parallel_lab.cli.run import run_ranks
from tests.support.model_parallel import assert_matches_reference, train_configuration


def each_configuration(
    configs: dict[str, list[str]], steps: int, global_batch: int, base: list[str], check: Callable
) -> None:
    """Run on every rank: train each configuration (base + its overrides) in turn, assert it matches
    the reference, then check(overrides, metrics, strategy, ref) (judge_each's loop)."""

    def judge(name: str, overrides: list[str], cfg, strategy, metrics) -> None:
        ref = assert_matches_reference(cfg, strategy, metrics, " ".join([*base, *overrides]))
        check(overrides, metrics, strategy, ref)

    judge_each(configs, steps, global_batch, base, judge)


def judge_each(configs: dict[str, list[str]], steps: int, global_batch: int, base: list[str], judge: Callable) -> None:
    """Run on every rank: train each configuration (base + its overrides) in turn, then
    judge(name, overrides, cfg, strategy, metrics). A failed assertion is recorded under the
    configuration's id instead of raised, so the next configuration still runs; the strategy is torn
    down and the ranks meet at a barrier after every configuration either way. Prints one JSON line:
    id -> this rank's assertion traceback, or null. Anything but an AssertionError (a crash) still
    ends the ranks, and run_ranks shows every rank's stderr."""
    errors: dict[str, str | None] = {}
    for name, overrides in configs.items():
        cfg, strategy, metrics = train_configuration(steps, global_batch, *base, *overrides)
        try:
            judge(name, overrides, cfg, strategy, metrics)
            errors[name] = None
        except AssertionError:
            errors[name] = traceback.format_exc()
        strategy.teardown()
        dist.barrier()
    print(json.dumps(errors))


def run_configurations(body: Callable, configs: dict[str, list[str]], world_size: int, **kwargs) -> dict[str, list]:
    """run_ranks(body) over every configuration in one set of ranks; id -> each rank's assertion
    traceback (None: that rank's checks passed)."""
    outputs = run_ranks(body, world_size, configs=configs, **kwargs)
    per_rank = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    return {name: [errors[name] for errors in per_rank] for name in configs}


def assert_every_rank_passed(results: dict[str, list], name: str) -> None:
    """The configuration's checks passed on every rank; else each failing rank's traceback."""
    failed = {rank: error for rank, error in enumerate(results[name]) if error is not None}
    assert not failed, f"{name}:\n" + "\n".join(f"--- rank {rank} ---\n{error}" for rank, error in failed.items())


def selected(request, configs: dict[str, list[str]], param: str = "config") -> dict[str, list[str]]:
    """The configurations this session's selected tests of the fixture's module read (their ``param``),
    in the matrix's order: make test's second pass selects one id of a file (tests/support/dispatch.py),
    and training the others under ATen's default kernels would cost it time for nothing."""
    wanted = {
        item.callspec.params[param]
        for item in request.session.items
        if item.module is request.module and param in getattr(getattr(item, "callspec", None), "params", {})
    }
    return {name: overrides for name, overrides in configs.items() if name in wanted}
