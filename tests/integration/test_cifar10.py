"""Training on a CIFAR-10 python tarball end to end (a tiny one in the exact format,
tests/support/cifar10_tarball.py); the loader itself: tests/unit/test_cifar10.py."""

from __future__ import annotations

from parallel_lab.cli.run import load_metrics
from tests.support.cifar10_tarball import build_tarball, md5_of
from tests.support.cli import run_cli


def test_training_on_the_tarball_end_to_end(tmp_path):
    path = build_tarball(tmp_path)
    run_cli(
        tmp_path / "run",
        "strategy=ddp",
        "data=cifar10",
        f"data.root={tmp_path}",
        f"data.md5={md5_of(path)}",
        "trainer.steps=2",
        "trainer.global_batch=16",
    )
    metrics = load_metrics(tmp_path / "run")
    assert metrics["data"] == "cifar10" and len(metrics["losses"]) == 2
