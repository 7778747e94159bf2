"""The planner (``python -m parallel_lab.plan``) against measured runs at world size 3: every
strategy's ``predicted_*`` within 1% of what its ranks measured (make test checks world 2, and
manual_ddp at 3, on its own runs). The planner itself, in-process: tests/unit/test_plan.py."""

from __future__ import annotations

import pytest

from parallel_lab.cli.run import load_metrics, run_cli
from tests.support.checks import assert_plan_matches

WORLD3 = ["ddp", "manual_ddp", "fsdp", "zero0", "zero1", "zero2", "zero3", "pp"]  # tp: 3 divides no split width


@pytest.mark.extra  # make test: assert_plan_matches on the runs of test_sharded/test_spine/test_*_parallel
@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "resnet18"])
@pytest.mark.parametrize("strategy", WORLD3)
def test_plan_within_one_percent_of_every_strategy_at_world_3(tmp_path, model, strategy):
    run_dir = tmp_path / strategy
    extra = ["strategy.stages=3"] if strategy == "pp" else []
    run_cli(
        run_dir,
        f"strategy={strategy}",
        "world_size=3",
        f"model={model}",
        "trainer.steps=1",
        "trainer.global_batch=12",
        "trainer.eval_batches=0",
        "trainer.warmup_steps=0",
        *extra,
        timeout=600,
    )
    metrics = load_metrics(run_dir)
    assert metrics["world_size"] == 3
    assert_plan_matches(metrics)
