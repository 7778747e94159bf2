"""The data-parallel family (dp, manual_ddp, ddp) gives the single-process baseline's losses.

Reference: tests/reference.py::reference_run, a plain torch loop written independently of the
toolkit. Gradient accumulation must not change the loss either (the reported loss is the mean over
the global batch, and the gradient is the global-batch mean), so grad_accum=2 runs are compared
with the same grad_accum=1 reference.
"""
from __future__ import annotations

import itertools
import json

import pytest
from omegaconf import OmegaConf

from parallel_lab.testing import run_ranks
from tests.conftest import assert_losses_close, load_metrics, run_cli
from tests.reference import reference_run

RTOL = 1e-5
STEPS, BATCH = 3, 24  # 24 splits over 2 or 3 ranks x grad_accum 2
ALGORITHMS = ("star", "ring", "builtin")
CNN = ("model=cnn", f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}")


@pytest.fixture(scope="module")
def cnn_reference():
    losses, checksum, _ = reference_run("cnn", steps=STEPS, global_batch=BATCH)
    return losses, checksum


def compose(path, *overrides: str) -> str:
    """The resolved config.yaml the CLI parent would write, for in-process training bodies."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from parallel_lab.config import CONF_DIR, register_configs, validate

    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=["trainer.progress=false", *overrides])
    cfg = validate(cfg)
    OmegaConf.save(cfg, path, resolve=True)
    return str(path)


@pytest.mark.parametrize("world_size", [2, 3])
def test_manual_ddp_every_allreduce_and_bucketing_matches_reference(tmp_path, cnn_reference, world_size):
    """3 algorithms x bucketed/unbucketed x grad_accum 1/2, in one set of ranks."""
    combos = list(itertools.product(ALGORITHMS, (True, False), (1, 2)))
    paths = [
        # bucket_mb=0.1 (~100 KiB): the cnn's ~1.2 MB of gradients spans many buckets.
        compose(tmp_path / f"c{i}.yaml", "strategy=manual_ddp", f"world_size={world_size}", *CNN,
                f"strategy.allreduce={algo}", f"strategy.bucketed={bucketed}", "strategy.bucket_mb=0.1",
                f"trainer.grad_accum={accum}")
        for i, (algo, bucketed, accum) in enumerate(combos)
    ]
    out = run_ranks("tests.dist_bodies_data_parallel:train_configs", world_size=world_size, timeout=300,
                    config_paths=paths, broadcast_check=paths[0])
    results = json.loads(out[0])
    ref_losses, ref_checksum = cnn_reference
    for (algo, bucketed, accum), result in zip(combos, results):
        label = f"allreduce={algo} bucketed={bucketed} grad_accum={accum}"
        assert (result["buckets"] > 1) == bucketed, label
        try:
            assert_losses_close(result["losses"], ref_losses, RTOL)
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from None
        assert result["final_param_checksum"] == pytest.approx(ref_checksum, rel=1e-5, abs=1e-4), label


def test_manual_ddp_cli_run(tmp_path, cnn_reference):
    """One real CLI run: metrics say how gradients were synchronised, accuracy is recorded."""
    run_cli(tmp_path / "run", "strategy=manual_ddp", "world_size=2", *CNN, "trainer.grad_accum=2")
    metrics = load_metrics(tmp_path / "run")
    assert_losses_close(metrics["losses"], cnn_reference[0], RTOL)
    assert metrics["strategy_options"] == {"name": "manual_ddp", "allreduce": "ring", "bucketed": True, "bucket_mb": 25.0}
    assert metrics["buckets"] == 1  # ~1.2 MB of cnn gradients fit one 25 MiB bucket
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    assert metrics["analytic_sent_bytes_per_step_rank0"] == metrics["ranks"][0]["grad_bytes"]  # 2(N-1)/N = 1


@pytest.mark.parametrize("accum", [1, 2])
def test_dp_matches_reference_with_one_replica_on_cpu(cli, cnn_reference, accum):
    metrics = cli("strategy=dp", "world_size=2", *CNN, f"trainer.grad_accum={accum}")
    assert metrics["world_size"] == 1 and metrics["replicas"] == 1
    assert_losses_close(metrics["losses"], cnn_reference[0], RTOL)
    assert metrics["final_param_checksum"] == pytest.approx(cnn_reference[1], rel=1e-5, abs=1e-4)


def test_ddp_no_sync_accumulation_matches_reference(cli, cnn_reference):
    """no_sync() on the first micro-batch, several small buckets, gradients outside the buckets."""
    metrics = cli("strategy=ddp", "world_size=2", *CNN, "trainer.grad_accum=2", "strategy.bucket_cap_mb=0.5",
                  "strategy.gradient_as_bucket_view=false")
    assert_losses_close(metrics["losses"], cnn_reference[0], RTOL)
    assert all(r["comm_buffer_bytes"] == r["grad_bytes"] > 0 for r in metrics["ranks"])
    assert metrics["final_param_checksum"] == pytest.approx(cnn_reference[1], rel=1e-5, abs=1e-4)


def test_eval_accuracy_is_the_same_summed_over_ranks(cli, cnn_reference):
    """Accuracy counts are all-reduced over ranks: the 2-rank value equals the 1-process one."""
    from parallel_lab.data import eval_batches
    from parallel_lab.data.synthetic import make_synthetic

    _, _, net = reference_run("cnn", steps=STEPS, global_batch=BATCH)
    eval_set = make_synthetic(max(4096 // 8, 64), 1)
    correct = total = 0
    for x, y in eval_batches(eval_set, BATCH, 2, 0, 1):
        correct += int((net(x).argmax(1) == y).sum())
        total += len(y)
    metrics = cli("strategy=manual_ddp", "world_size=3", *CNN, "strategy.allreduce=star")
    assert metrics["eval_accuracy"] == pytest.approx(correct / total)
    assert_losses_close(metrics["losses"], cnn_reference[0], RTOL)


@pytest.mark.parametrize("strategy", ["manual_ddp", "dp"])
def test_resnet18_few_steps_match_reference(cli, strategy):
    ref_losses, _, _ = reference_run("resnet18", steps=2, global_batch=8)
    metrics = cli(f"strategy={strategy}", "model=resnet18", "trainer.steps=2", "trainer.global_batch=8",
                  "trainer.eval_batches=0", "strategy.bucket_mb=5" if strategy == "manual_ddp" else "trainer.grad_accum=1")
    assert_losses_close(metrics["losses"], ref_losses, RTOL)
    if strategy == "manual_ddp":
        assert metrics["buckets"] > 1
