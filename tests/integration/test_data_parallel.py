"""The data-parallel family (dp, manual_ddp, ddp) gives the single-process baseline's losses.

Reference: tests/support/reference.py::parity_reference, a plain torch loop written independently of the
toolkit, and its noise-floor reruns: parity is judged against that measured envelope, as the report
does. Gradient accumulation must not change the loss either (the reported loss is the mean over
the global batch, and the gradient is the global-batch mean), so grad_accum=2 runs are compared
with the same grad_accum=1 reference.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from parallel_lab.cli.run import load_metrics, run_ranks
from parallel_lab.models import build_meta_model
from parallel_lab.plan.configs import planned_configs
from parallel_lab.protocol import load_final_params
from parallel_lab.strategies.ddp_rules import DDPPlan
from tests.support.bodies.data_parallel import train_configs
from tests.support.checks import assert_plan_matches
from tests.support.cli import run_cli, write_config
from tests.support.reference import parity_reference

pytestmark = pytest.mark.parity  # every test here judges parity (make test runs them twice)

STEPS, BATCH = 3, 24  # 24 splits over 2 or 3 ranks x grad_accum 2
ALGORITHMS = ("star", "ring", "builtin")
CNN = ("model=cnn", f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}")


@pytest.fixture(scope="module")
def cnn_reference():
    return parity_reference("cnn", steps=STEPS, global_batch=BATCH)


COMBOS = list(itertools.product(ALGORITHMS, (True, False), (1, 2)))  # allreduce x bucketed x grad_accum


@pytest.fixture(scope="module")
def manual_ddp_matrix(tmp_path_factory):
    """matrix(world_size): combo -> (result, config path) of every COMBOS run, all trained in ONE set
    of world_size ranks, once per world size."""
    done: dict[int, dict] = {}

    def matrix(world_size: int) -> dict:
        if world_size not in done:
            root = tmp_path_factory.mktemp(f"manual_ddp_world{world_size}")
            paths = [
                # bucket_mb=0.1 (~100 KiB): the cnn's ~1.2 MB of gradients spans many buckets.
                write_config(
                    root / f"c{i}.yaml",
                    "strategy=manual_ddp",
                    f"world_size={world_size}",
                    *CNN,
                    f"strategy.allreduce={algo}",
                    f"strategy.bucketed={bucketed}",
                    "strategy.bucket_mb=0.1",
                    f"trainer.grad_accum={accum}",
                )
                for i, (algo, bucketed, accum) in enumerate(COMBOS)
            ]
            out = run_ranks(
                train_configs,
                world_size=world_size,
                timeout=300,
                config_paths=paths,
                broadcast_check=paths[0],
            )
            done[world_size] = dict(zip(COMBOS, zip(json.loads(out[0]), paths)))
        return done[world_size]

    return matrix


@pytest.mark.parametrize(
    "algo, bucketed, accum", COMBOS, ids=[f"{a}-{'bucketed' if b else 'unbucketed'}-accum{n}" for a, b, n in COMBOS]
)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extra)])
def test_manual_ddp_every_allreduce_and_bucketing_matches_reference(
    manual_ddp_matrix, cnn_reference, world_size, algo, bucketed, accum
):
    """3 algorithms x bucketed/unbucketed x grad_accum 1/2, in one set of ranks per world size."""
    result, path = manual_ddp_matrix(world_size)[(algo, bucketed, accum)]
    label = f"allreduce={algo} bucketed={bucketed} grad_accum={accum}"
    assert result["replicas_equal"], f"replicas differ: {path}"
    assert (result["buckets"] > 1) == bucketed, label
    cnn_reference.assert_matches(result["losses"], load_final_params(Path(path).with_suffix("")), label)


def test_manual_ddp_cli_run(tmp_path, cnn_reference):
    """One real CLI run: metrics say how gradients were synchronised, accuracy is recorded."""
    run_cli(tmp_path / "run", "strategy=manual_ddp", "world_size=2", *CNN, "trainer.grad_accum=2")
    metrics = {**load_metrics(tmp_path / "run"), "run_dir": tmp_path / "run"}
    cnn_reference.assert_run_matches(metrics)
    assert metrics["strategy_options"] == {
        "name": "manual_ddp",
        "allreduce": "ring",
        "bucketed": True,
        "bucket_mb": 25.0,
        "precision": "fp32",
    }
    assert metrics["strategy_extras"]["buckets"] == 1  # ~1.2 MB of cnn gradients fit one 25 MiB bucket
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert (
        metrics["strategy_extras"]["analytic_sent_bytes_per_step_rank0"] == metrics["ranks"][0]["grad_bytes"]
    )  # 2(N-1)/N = 1
    assert metrics["strategy_extras"]["hand_transport"].startswith("shm")  # both ranks on this host


@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.extra), 2])
def test_dp_matches_reference_with_one_replica_on_cpu(cli, cnn_reference, accum):
    metrics = cli("strategy=dp", "world_size=2", *CNN, f"trainer.grad_accum={accum}")
    assert metrics["world_size"] == 1 and metrics["strategy_extras"]["replicas"] == 1
    cnn_reference.assert_run_matches(metrics)


def test_ddp_no_sync_accumulation_matches_reference(cli, cnn_reference):
    """no_sync() on the first micro-batch, several small buckets, gradients outside the buckets;
    the reducer's buckets are the ones the step-time model pays an all-reduce for."""
    overrides = ("strategy=ddp", "world_size=2", *CNN, "trainer.grad_accum=2", "strategy.bucket_cap_mb=0.05")
    metrics = cli(*overrides, "strategy.gradient_as_bucket_view=false")
    cnn_reference.assert_run_matches(metrics)
    assert all(r["comm_buffer_bytes"] == r["grad_bytes"] > 0 for r in metrics["ranks"])
    (planned,) = planned_configs(list(overrides))
    predicted = DDPPlan.collective_calls(planned.cfg, build_meta_model(planned.cfg.model))
    assert metrics["strategy_extras"]["buckets"] == predicted["all_reduce"] == 4  # fc1's 1 MB weight fills one


def test_eval_accuracy_is_the_same_summed_over_ranks(cli, cnn_reference):
    """Accuracy counts are all-reduced over ranks: the 2-rank value equals the 1-process one."""
    from parallel_lab.data import eval_batches
    from parallel_lab.data.synthetic import make_synthetic

    net = cnn_reference.net
    eval_set = make_synthetic(max(4096 // 8, 64), 1)
    correct = total = 0
    for x, y in eval_batches(eval_set, BATCH, 2, 0, 1):
        correct += int((net(x).argmax(1) == y).sum())
        total += len(y)
    metrics = cli("strategy=manual_ddp", "world_size=3", *CNN, "strategy.allreduce=star")
    assert metrics["eval_accuracy"] == pytest.approx(correct / total)
    cnn_reference.assert_run_matches(metrics)
    assert_plan_matches(metrics)  # world 3


@pytest.mark.extra  # resnet18 parity: make test-all (test_spine.py: single, ddp)
@pytest.mark.parametrize("strategy", ["manual_ddp", "dp"])
def test_resnet18_few_steps_match_reference(cli, strategy):
    ref = parity_reference("resnet18", steps=2, global_batch=8)
    metrics = cli(
        f"strategy={strategy}",
        "model=resnet18",
        "trainer.steps=2",
        "trainer.global_batch=8",
        "trainer.eval_batches=0",
        "strategy.bucket_mb=5" if strategy == "manual_ddp" else "trainer.grad_accum=1",
    )
    ref.assert_run_matches(metrics)
    if strategy == "manual_ddp":
        assert metrics["strategy_extras"]["buckets"] > 1
