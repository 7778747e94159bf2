"""model=gpt on data=tokens trained by the strategies on real ranks: each row the same training as
the independent single-process reference (tests/support/reference.py, judged by the report's
parity criterion) and every rank's model state exactly what the planner predicted. The model
itself, in-process: tests/unit/test_gpt.py; docs/gpt.md."""

from __future__ import annotations

import math

import pytest

from tests.support.checks import assert_plan_matches
from tests.support.reference import GPT_RUN, GPT_SIZES, parity_reference

STEPS, BATCH = 4, 8
RUN = (*GPT_RUN, "world_size=2", f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}")
DATA_PARALLEL = ["single", "dp", "manual_ddp", "ddp", "fsdp", "zero0", "zero1", "zero2", "zero3"]
DROPOUT = "model.dropout=0.1"


@pytest.fixture(scope="module")
def reference():
    return parity_reference("gpt", steps=STEPS, global_batch=BATCH)


@pytest.fixture(scope="module")
def dropout_reference():
    return parity_reference("gpt_dropout", steps=STEPS, global_batch=BATCH)


def check_row(metrics: dict, reference) -> None:
    assert metrics["model"] == "gpt" and metrics["data"] == "tokens" and len(metrics["losses"]) == STEPS
    reference.assert_run_matches(metrics, f"gpt {metrics['strategy']}")
    assert_plan_matches(metrics, tolerance=0.0)  # exact, as for the vit


@pytest.mark.slow
@pytest.mark.parity
def test_ddp_trains_the_gpt_with_dropout_as_single_does_and_as_planned(cli, dropout_reference):
    """Tied embeddings (the default) and dropout keyed by each sample's tokens: each rank draws, for
    its half of the batch, single's masks. The default evaluation runs: next-token accuracy over
    every position of the held-out sequences."""
    metrics = cli("strategy=ddp", DROPOUT, *RUN)
    check_row(metrics, dropout_reference)
    assert metrics["losses"][0] == pytest.approx(math.log(GPT_SIZES["vocab"]), rel=0.05)  # untrained: uniform
    assert 0 <= metrics["eval_accuracy"] <= 1


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("strategy", DATA_PARALLEL)
def test_every_data_parallel_strategy_trains_the_gpt_as_single_does_and_as_planned(cli, reference, strategy):
    check_row(cli(f"strategy={strategy}", *RUN, "trainer.eval_batches=0"), reference)


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("impl", ["manual", "torch", "deepspeed"])
def test_pp_trains_the_untied_gpt_as_single_does_and_as_planned(cli, impl):
    """Embedding on the first stage, head and loss on the last; tied embeddings are refused under pp
    (tests/unit/test_gpt.py)."""
    reference = parity_reference("gpt_untied", steps=STEPS, global_batch=BATCH)
    run = cli("strategy=pp", f"strategy.impl={impl}", "model.tied=false", *RUN, "trainer.eval_batches=0")
    check_row(run, reference)


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("extra", [(), ("world_size=4", "strategy.replicate=2")])
def test_deepspeed_pipeline_ties_the_gpt_embedding_as_single_does_and_as_planned(cli, extra):
    """model.tied=true under strategy.impl=deepspeed (pp/ds_pipe.py): the last stage's copy of the
    embedding in its layers, its gradient summed with the first stage's by DeepSpeed's engine
    (``_exec_reduce_tied_grads``, over the toolkit's embedding group) before the replicas' average.
    SGD: a tied gradient scaled by a constant shows, where Adam divides it out. Each end all-reduces
    the tied weight's fp32 gradient, 2 x 4 V h bytes, derived here."""
    reference = parity_reference("gpt", steps=STEPS, global_batch=BATCH, optimizer="sgd")
    base = [o for o in RUN if not any(o.split("=")[0] == x.split("=")[0] for x in extra)]
    run = cli(
        "strategy=pp", "strategy.impl=deepspeed", *base, *extra, "trainer.optimizer=sgd", "trainer.eval_batches=0"
    )
    check_row(run, reference)
    tied = 2.0 * 4 * GPT_SIZES["vocab"] * GPT_SIZES["hidden"]
    assert [r["comm_bytes_by_group"].get("embedding") for r in run["ranks"]] == [tied] * len(run["ranks"])
