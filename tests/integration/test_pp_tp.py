"""dp x pp x tp on the vit (``strategy=pp strategy.tp=2``, pp/tensor.py): every configuration
trains as single does (the report's parity criterion against the plain-torch reference, with the
gathered parameters the unsplit model's), every rank holds the planned model state to the byte,
issues the planned communication and (the first pipeline) stashes the planned activations.
World 4 = 2 stages x tp 2 in make test; world 8 adds strategy.replicate=2 (extra). Bad input:
tests/unit/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest

from tests.support.bodies.pp_tp import pp_tp_body
from tests.support.matrix import assert_every_rank_passed, run_configurations
from tests.support.reference import GPT_RUN, GPT_VARIANTS

STEPS, BATCH = 3, 16
# one run of 4 ranks (it runs twice in make test: parity): every part of pp x tp at once, SP's
# token-sliced sends and gradient sums, dropout's sliced masks, clipping over tp and pp, 1F1B
DEFAULT = {
    "1f1b-sp-dropout-clip": [
        "strategy.schedule=1f1b", "strategy.sequence_parallel=true", "model.dropout=0.1", "trainer.grad_clip=0.05",
    ],
}  # fmt: skip
# dp x pp on the tied gpt in the same ranks (tests/support/bodies/pp_gpt.py check_pp_tied_replicas):
# 2 pipelines of 2 stages, no tp; SGD: a tied gradient scaled by a constant shows, where Adam divides it out
TIED_GPT = {
    "dp-pp-tied-gpt-sgd": [
        *GPT_RUN, "strategy.tp=1", "strategy.replicate=2", "model.tied=true", "trainer.optimizer=sgd",
        "trainer.eval_batches=0",
    ],
}  # fmt: skip
# pp x cp in the same ranks (tests/support/bodies/pp_cp.py): 2 stages x cp 2, the vit and the gpt,
# ring and Ulysses, gpipe (the default) and 1f1b; the gpt's ring causal and load-balanced on GQA
# (2 kv heads, rotary, SwiGLU, untied), its Ulysses on the tied gpt. name -> (overrides, the gpt's
# reference model). make test: two rows (~5 s), one of each impl, model and schedule; the other
# two pairings under extra.
LLAMA = [*GPT_RUN, *(f"model.{key}={str(value).lower()}" for key, value in GPT_VARIANTS["gpt_llama"].items())]
CP = ["strategy.tp=1", "strategy.cp=2"]
PP_CP = {
    "pp-cp-ulysses-1f1b": ([*CP, "strategy.cp_impl=ulysses", "strategy.schedule=1f1b"], None),
    "pp-cp-gpt-ring": ([*LLAMA, *CP], "gpt_llama"),
}
PP_CP_EXTRA = {
    "pp-cp-ring": ([*CP], None),
    "pp-cp-gpt-ulysses-1f1b": ([*GPT_RUN, *CP, "strategy.cp_impl=ulysses", "strategy.schedule=1f1b"], "gpt"),
}
WORLD4_EXTRA = {
    "1f1b-dropout-clip": ["strategy.schedule=1f1b", "model.dropout=0.1", "trainer.grad_clip=0.05"],
    "sp-gpipe": ["strategy.sequence_parallel=true"],
    # Megatron's bf16 in 2-D: bf16 copies of each stage's fp32 shards, bf16 sends and tp collectives
    "1f1b-sp-bf16": ["strategy.schedule=1f1b", "strategy.sequence_parallel=true", "trainer.precision=bf16"],
    "interleaved-sp": [
        "strategy.schedule=interleaved_1f1b",
        "strategy.virtual_stages=2",
        "strategy.sequence_parallel=true",
    ],
}
EXTRA = {  # world 8: 2 pipelines of 2 stages x tp 2
    "replicate-1f1b-dropout-clip": [
        "strategy.replicate=2", "strategy.schedule=1f1b", "model.dropout=0.1", "trainer.grad_clip=0.05",
    ],
    "replicate-sp": ["strategy.replicate=2", "strategy.sequence_parallel=true"],
}  # fmt: skip


@pytest.fixture(scope="module")
def default_results() -> dict[str, list]:
    configs = {**DEFAULT, **TIED_GPT, **{name: overrides for name, (overrides, _) in PP_CP.items()}}
    references = {name: ref for name, (_, ref) in PP_CP.items()}
    return run_configurations(
        pp_tp_body, configs, world_size=4, timeout=300, steps=STEPS, global_batch=BATCH, references=references
    )


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(DEFAULT))
def test_two_stages_x_tp2_is_singles_training_with_the_planned_state(default_results, config):
    assert_every_rank_passed(default_results, config)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(TIED_GPT))
def test_dp_x_pp_ties_the_gpt_embedding_in_every_pipeline(default_results, config):
    """model=gpt model.tied=true, strategy.replicate=2 at world 4: single's training, the four ends'
    copies bit-equal, state and bytes as planned, the embedding group's all-reduce derived."""
    assert_every_rank_passed(default_results, config)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(PP_CP))
def test_two_stages_x_cp2_is_singles_training_with_the_formulas_bytes(default_results, config):
    """strategy=pp strategy.cp=2 at world 4 (pp/cp.py): single's training, every rank's state as
    planned, its bytes measured = planned = the formula derived from the shapes (hand-offs of
    T/cp tokens, the ring's or Ulysses' bytes on the stage's blocks, the pool on the vit's last
    stage, the cp group's gradient average), every rank's activations as planned."""
    assert_every_rank_passed(default_results, config)


@pytest.fixture(scope="module")
def world4_extra_results() -> dict[str, list]:
    configs = {**WORLD4_EXTRA, **{name: overrides for name, (overrides, _) in PP_CP_EXTRA.items()}}
    references = {name: ref for name, (_, ref) in PP_CP_EXTRA.items()}
    return run_configurations(
        pp_tp_body, configs, world_size=4, timeout=600, steps=STEPS, global_batch=BATCH, references=references
    )


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(WORLD4_EXTRA))
def test_two_stages_x_tp2_more_configurations(world4_extra_results, config):
    """Without SP, SP alone, interleaved; test_two_stages_x_tp2_is_singles_training_with_the_planned_state
    keeps the claim in make test."""
    assert_every_rank_passed(world4_extra_results, config)


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(PP_CP_EXTRA))
def test_two_stages_x_cp2_more_configurations(world4_extra_results, config):
    """The vit's ring under gpipe, the tied gpt's Ulysses under 1f1b: the same checks as
    test_two_stages_x_cp2_is_singles_training_with_the_formulas_bytes, which keeps the claim in make test."""
    assert_every_rank_passed(world4_extra_results, config)


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(EXTRA))
def test_dp_x_pp_x_tp_at_world_8(config):
    """The 3-D mesh (replicate 2 x 2 stages x tp 2; slow on 2 cores: extra);
    test_two_stages_x_tp2_is_singles_training_with_the_planned_state keeps the claim in make test."""
    results = run_configurations(pp_tp_body, {config: EXTRA[config]}, world_size=8, timeout=600, steps=STEPS,
                                 global_batch=BATCH)  # fmt: skip
    assert_every_rank_passed(results, config)
