"""strategy=tp on model=gpt (Megatron's split with the vocabulary split at both ends, tp/vocab.py)
on 2 real ranks: each configuration is the single run's training (the report's parity criterion
against the plain-torch reference), predicts single's logits from the gathered vocabulary columns,
holds the planned model state to the byte, issues exactly the communication of the vocab-parallel
formula derived in the test body (also the planner's prediction) and saves the activations the
planner counts. The cross-entropy alone and the refusals: tests/unit/test_vocab_parallel.py. In the
same ranks: the tied gpt under strategy=pp (tests/support/bodies/pp_gpt.py)."""

from __future__ import annotations

import pytest

from tests.support.bodies.tp_gpt import tp_gpt_body
from tests.support.matrix import assert_every_rank_passed, run_configurations

STEPS, BATCH = 3, 8
LLAMA = ["model.tied=false", "model.kv_heads=2", "model.mlp=swiglu", "model.positions=rotary"]
# name -> (overrides, the reference model of tests/support/reference.py MODELS)
DEFAULT = {  # one set of ranks for the default suite
    "tied-dropout": (["model.dropout=0.1"], "gpt_dropout"),  # the head on the embedding's shard; sliced masks
    "llama-sp": ([*LLAMA, "model.bias=false", "strategy.sequence_parallel=true"], "gpt_llama"),  # GQA, untied, SP
}
EXTRA = {
    "tied": ([], "gpt"),
    "tied-sp-dropout": (["model.dropout=0.1", "strategy.sequence_parallel=true"], "gpt_dropout"),
    "llama-dropout": ([*LLAMA, "model.dropout=0.1"], "gpt_llama_dropout"),
    "untied-grad_accum": (["model.tied=false", "trainer.grad_accum=2"], "gpt_untied"),
    "llama-sp-recompute": (
        [*LLAMA, "model.dropout=0.1", "strategy.sequence_parallel=true", "trainer.recompute=full"],
        "gpt_llama_dropout",
    ),  # fmt: skip
    # bf16 without biases: a row layer adds its bias after the all-reduce, a second bf16 rounding that
    # single's fused addmm skips (measured: the first losses then 19x the bf16 reference's envelope)
    "untied-sp-bf16": (
        ["model.tied=false", "model.bias=false", "strategy.sequence_parallel=true", "trainer.precision=bf16"],
        "gpt_untied_nobias",
    ),
}


# strategy=pp on the tied gpt (tests/support/bodies/pp_gpt.py), in the same ranks: one start-up
# SGD in make test's: a tied gradient scaled by a constant (averaged, not summed) shows, where Adam divides it out
PP_DEFAULT = {"pp-tied-1f1b-sgd": (["strategy=pp", "strategy.schedule=1f1b", "trainer.optimizer=sgd"], "gpt")}
PP_EXTRA = {
    # the clipping norm counts the tied weight once (0.05: below the gradient's norm, so it clips;
    # SGD: Adam would divide a uniformly scaled gradient out)
    "pp-tied-gpipe-grad_clip-sgd": (["strategy=pp", "trainer.grad_clip=0.05", "trainer.optimizer=sgd"], "gpt"),
    "pp-tied-interleaved": (
        ["strategy=pp", "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"],
        "gpt",
    ),
    "pp-tied-zero_bubble": (["strategy=pp", "strategy.schedule=zero_bubble"], "gpt"),
    "pp-tied-torch-1f1b": (["strategy=pp", "strategy.impl=torch", "strategy.schedule=1f1b"], "gpt"),
    "pp-tied-bf16": (["strategy=pp", "strategy.schedule=1f1b", "trainer.precision=bf16"], "gpt"),
    "pp-tied-dropout-grad_accum": (["strategy=pp", "model.dropout=0.1", "trainer.grad_accum=2"], "gpt_dropout"),
}


def _run(configs: dict, timeout: int) -> dict[str, list]:
    overrides = {name: o for name, (o, _) in configs.items()}
    references = {name: r for name, (_, r) in configs.items()}
    return run_configurations(
        tp_gpt_body, overrides, world_size=2, timeout=timeout, references=references, steps=STEPS, global_batch=BATCH
    )


@pytest.fixture(scope="module")
def default_results() -> dict[str, list]:
    return _run({**DEFAULT, **PP_DEFAULT}, 300)


@pytest.fixture(scope="module")
def extra_results() -> dict[str, list]:
    return _run({**EXTRA, **PP_EXTRA}, 600)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(DEFAULT))
def test_tp_gpt_is_singles_training_with_the_vocab_parallel_bytes(default_results, config):
    assert_every_rank_passed(default_results, config)


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(EXTRA))
def test_tp_gpt_more_configurations(extra_results, config):
    """The rest of the matrix; the test above keeps the claim in make test."""
    assert_every_rank_passed(extra_results, config)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(PP_DEFAULT))
def test_pp_ties_the_gpt_embedding_across_its_stages(default_results, config):
    """model.tied=true under strategy=pp (Megatron's embedding group, pp/tied.py): single's training,
    the last stage's copy bit-equal to the first's, state, bytes and activations as planned, a
    checkpoint of single's names that reshards into both copies (tests/support/bodies/pp_gpt.py)."""
    assert_every_rank_passed(default_results, config)


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(PP_EXTRA))
def test_pp_ties_the_gpt_embedding_under_more_schedules(extra_results, config):
    """The other manual schedules, torch's 1F1B, bf16, dropout with gradient accumulation, Adam; the
    test above keeps the claim in make test."""
    assert_every_rank_passed(extra_results, config)
