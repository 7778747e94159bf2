"""strategy.cp on model=vit and model=gpt (context parallelism, parallel_lab/strategies/cp) on 2 real
ranks, each cp_impl under ddp and ring under fsdp (extra: fsdp x cp x tp, fsdp x tp and HSDP x cp on 4 ranks); the gpt's
causal, load-balanced ring with grouped-query attention and rotary positions, its Ulysses and
DeepSpeed's, in the same ranks: each configuration is the single run's training (the report's
parity criterion against the plain-torch reference), holds the planned model state to the byte,
issues exactly the communication of the formula derived in the test body (which is also the
planner's prediction), and saves the activations the planner counts. Attention alone against full
attention: tests/unit/test_cp.py."""

from __future__ import annotations

import pytest

from tests.support.bodies.cp_vit import cp_vit_body
from tests.support.matrix import assert_every_rank_passed, run_configurations
from tests.support.reference import GPT_MOE, GPT_RUN, GPT_VARIANTS

STEPS, BATCH = 2, 16
LLAMA = [*GPT_RUN, *(f"model.{key}={str(value).lower()}" for key, value in GPT_VARIANTS["gpt_llama"].items())]
# name -> the reference model (tests/support/reference.py MODELS): make test's three cp_impl on one
# (GQA with kv_heads 2, rotary positions: one reference computed), extra's fsdp on the plain gpt
# (learned positions, tied embedding)
GPT = {
    "gpt-ddp-ring": "gpt_llama",
    "gpt-ddp-ulysses": "gpt_llama",
    "gpt-ddp-deepspeed": "gpt_llama",
    "gpt-moe-ddp-ep": "gpt_moe",
    "gpt-fsdp-ring": "gpt",
    "gpt-tp-cp-ring": "gpt_llama",
    "gpt-tp-cp-ulysses": "gpt",
    "gpt-tp-cp-ring-grad_accum": "gpt_llama",
    "gpt-fsdp-hsdp-cp-ring": "gpt",
    "gpt-fsdp-cp-tp-ring": "gpt",
}
# The MoE gpt under strategy=ddp strategy.ep=2 (expert parallelism, tests/integration/test_ep.py's
# claims for the vit), trained in these ranks to spare a start-up; SGD: see cp_gpt.py check_gpt_ep.
GPT_EP = [*GPT_RUN, *(f"model.{key}={value}" for key, value in GPT_MOE.items()), "strategy=ddp", "strategy.ep=2"]
DEFAULT = {  # one set of ranks for the default suite
    "ddp-ring": ["strategy=ddp", "strategy.cp=2", "strategy.cp_impl=ring"],
    "ddp-ulysses": ["strategy=ddp", "strategy.cp=2", "strategy.cp_impl=ulysses"],
    "ddp-deepspeed": ["strategy=ddp", "strategy.cp=2", "strategy.cp_impl=deepspeed"],
    "gpt-ddp-ring": [*LLAMA, "strategy=ddp", "strategy.cp=2", "strategy.cp_impl=ring"],
    "gpt-ddp-ulysses": [*LLAMA, "strategy=ddp", "strategy.cp=2", "strategy.cp_impl=ulysses"],
    "gpt-ddp-deepspeed": [*LLAMA, "strategy=ddp", "strategy.cp=2", "strategy.cp_impl=deepspeed"],
    "gpt-moe-ddp-ep": [*GPT_EP, "trainer.optimizer=sgd"],
}
# HSDP x CP: replicate 2 x (shard 1 x cp 2), fully_shard over shard x cp, all-reduced over replicate
HSDP_CP = ["strategy=fsdp", "strategy.sharding=hybrid", "strategy.replicate=2", "strategy.cp=2"]
EXTRA = {  # fully_shard over shard x cp (world 2), and torchtitan's shard x cp x tp at world 4: extra
    "fsdp-ring": ["strategy=fsdp", "strategy.cp=2"],
    "gpt-fsdp-ring": [*GPT_RUN, "strategy=fsdp", "strategy.cp=2"],
    "fsdp-tp": ["strategy=fsdp", "strategy.tp=2"],  # FSDP2 x TP without cp: its activations (test_tp_vit.py: the rest)
    "fsdp-cp-tp-ring": ["strategy=fsdp", "strategy.cp=2", "strategy.tp=2"],
    "fsdp-cp-tp-ulysses": ["strategy=fsdp", "strategy.cp=2", "strategy.tp=2", "strategy.cp_impl=ulysses"],
    # the gpt's cp x tp inside strategy=tp's vocab-parallel split (tests/support/bodies/cp_tp_gpt.py):
    # the causal ring on GQA's kv_heads/tp = 1 head a rank, SGD (a gradient scaled by a constant, the
    # cp group's average missed, would show; Adam divides it out); Ulysses on the tied gpt
    "gpt-tp-cp-ring": [*LLAMA, "strategy=tp", "strategy.cp=2", "strategy.tp=2", "trainer.optimizer=sgd"],
    "gpt-tp-cp-ulysses": [*GPT_RUN, "strategy=tp", "strategy.cp=2", "strategy.tp=2", "strategy.cp_impl=ulysses"],
    "gpt-tp-cp-ring-grad_accum": [*LLAMA, "strategy=tp", "strategy.cp=2", "strategy.tp=2", "trainer.grad_accum=2"],
    # fully_shard over shard x cp on top of the gpt's manual vocab-parallel split (tied embedding and
    # head in the root unit), the causal ring on heads/tp; SGD (cp_tp_gpt.py check_gpt_fsdp_cp_tp)
    "gpt-fsdp-cp-tp-ring": [*GPT_RUN, "strategy=fsdp", "strategy.cp=2", "strategy.tp=2", "trainer.optimizer=sgd"],
    "fsdp-hsdp-cp-ring": [*HSDP_CP],
    "gpt-fsdp-hsdp-cp-ring": [*GPT_RUN, *HSDP_CP],
}


@pytest.fixture(scope="module")
def default_results() -> dict[str, list]:
    return run_configurations(
        cp_vit_body, DEFAULT, world_size=2, timeout=300, steps=STEPS, global_batch=BATCH, references=GPT
    )


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(DEFAULT))
def test_cp_vit_is_singles_training_with_the_formulas_bytes(default_results, config):
    assert_every_rank_passed(default_results, config)


@pytest.fixture(scope="module")
def extra_results() -> dict[str, list]:
    world2 = {name: EXTRA[name] for name in ("fsdp-ring", "gpt-fsdp-ring")}
    world2 = run_configurations(
        cp_vit_body, world2, world_size=2, timeout=300, steps=STEPS, global_batch=BATCH, references=GPT
    )
    world4 = {name: overrides for name, overrides in EXTRA.items() if name not in world2}
    return {
        **world2,
        **run_configurations(
            cp_vit_body, world4, world_size=4, timeout=600, steps=STEPS, global_batch=BATCH, references=GPT
        ),
    }


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(EXTRA))
def test_fsdp_x_cp_is_singles_training(extra_results, config):
    """strategy=fsdp strategy.cp=2 (world 2, the vit and the gpt's causal ring: its bytes and
    activations checked as ddp's), and with strategy.tp=2 at world 4, and fsdp x tp without cp
    there (parity, the bytes, and every rank's activations saved by the real 2-D forward); HSDP x
    CP (replicate 2 x shard 1 x cp 2) on the vit and the gpt there, its state and bytes derived
    from the shapes (fsdp_tp.py hybrid_checks). Extra: the suite's budget; the cp attention itself
    is judged in make test above, the 2-D FSDP2 x TP split in test_tp_vit.py."""
    assert_every_rank_passed(extra_results, config)
