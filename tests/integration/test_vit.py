"""model=vit trained by the strategies on real ranks: each row the same training as the independent
single-process reference (tests/support/reference.py, judged by the report's parity criterion) and
every rank's model state exactly what the planner predicted. The model itself, in-process:
tests/unit/test_vit.py; the table of every strategy: docs/vit.md."""

from __future__ import annotations

import pytest

from tests.support.checks import assert_plan_matches
from tests.support.reference import parity_reference

STEPS, BATCH = 5, 16
RUN = ("model=vit", "world_size=2", f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}", "trainer.eval_batches=0")
DATA_PARALLEL = ["single", "dp", "manual_ddp", "ddp", "fsdp", "zero0", "zero1", "zero2", "zero3"]
DROPOUT = "model.dropout=0.1"  # tests/support/reference.py's vit_dropout


@pytest.fixture(scope="module")
def reference():
    return parity_reference("vit", steps=STEPS, global_batch=BATCH)


@pytest.fixture(scope="module")
def dropout_reference():
    return parity_reference("vit_dropout", steps=STEPS, global_batch=BATCH)


def check_row(metrics: dict, reference) -> None:
    assert metrics["model"] == "vit" and len(metrics["losses"]) == STEPS
    reference.assert_run_matches(metrics, f"vit {metrics['strategy']}")
    assert_plan_matches(metrics, tolerance=0.0)  # exact, as for cnn and resnet18


@pytest.mark.slow
@pytest.mark.parity
def test_fsdp_trains_the_vit_with_dropout_as_single_does_and_as_planned(cli, dropout_reference):
    """Each rank draws, for its half of the batch, the masks single draws for those samples."""
    assert_envelope_is_rounding_only(dropout_reference)
    check_row(cli("strategy=fsdp", DROPOUT, *RUN), dropout_reference)


def assert_envelope_is_rounding_only(reference) -> None:
    """The noise reruns include the batch summed in 2 and 4 micro-batches: with masks that depend
    on the split (nn.Dropout's) they are other trainings, the envelope grows to the masks' effect
    (~1e-2 in the loss at step 1) and any row passes. With per-sample masks they differ in rounding only."""
    for losses, _ in reference.noise:
        assert max(abs(a - b) for a, b in zip(losses, reference.losses)) < 1e-4, (losses, reference.losses)


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("strategy", DATA_PARALLEL + ["pp"])
def test_every_strategy_trains_the_vit_as_single_does_and_as_planned(cli, reference, strategy):
    check_row(cli(f"strategy={strategy}", *RUN), reference)


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("strategy", [s for s in DATA_PARALLEL if s != "fsdp"])
def test_every_data_parallel_strategy_draws_singles_dropout_masks(cli, dropout_reference, strategy):
    check_row(cli(f"strategy={strategy}", DROPOUT, *RUN), dropout_reference)


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
def test_pp_with_dropout_trains_the_vit_as_single_does(cli, dropout_reference):
    """Every stage keys its micro-batches from the pixels (strategies/pp/manual.py); the schedules
    in one set of ranks: tests/integration/test_pp_vit.py."""
    check_row(cli("strategy=pp", DROPOUT, *RUN), dropout_reference)
