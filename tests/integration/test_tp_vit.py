"""strategy=tp on model=vit (Megatron's split, tp/megatron.py) on 2 real ranks, both impls, with
and without sequence parallelism and dropout: each configuration is the single run's training
(the report's parity criterion against the plain-torch reference), holds the planned model state
to the byte, issues exactly the communication of the Megatron formula (which is also the planner's
prediction), and (manual) saves the activations the planner counts. Bad input:
tests/unit/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from tests.support.bodies.tp_vit import tp_vit_body
from tests.support.matrix import assert_every_rank_passed, run_configurations, selected

STEPS, BATCH = 3, 16
DEFAULT = {  # one set of ranks for the default suite: SP, per-rank dropout masks, both impls
    "manual-sp-dropout": ["strategy.impl=manual", "strategy.sequence_parallel=true", "model.dropout=0.1"],
    "dtensor-dropout": ["strategy.impl=dtensor", "model.dropout=0.1"],
    # Megatron's bf16 (bf16 copies of the fp32 shards; every collective in bf16), judged against the
    # bf16 reference loop and its own noise floor (docs/parity.md, bf16 rows)
    "manual-sp-bf16": ["strategy.impl=manual", "strategy.sequence_parallel=true", "trainer.precision=bf16"],
}
EXTRA = {
    "manual": ["strategy.impl=manual"],
    "manual-sp": ["strategy.impl=manual", "strategy.sequence_parallel=true"],
    "dtensor-sp": ["strategy.impl=dtensor", "strategy.sequence_parallel=true"],
    "dtensor": ["strategy.impl=dtensor"],
    "manual-dropout": ["strategy.impl=manual", "model.dropout=0.1"],
    "manual-sp-grad_accum": ["strategy.impl=manual", "strategy.sequence_parallel=true", "trainer.grad_accum=2"],
    "dtensor-sp-grad_accum": ["strategy.impl=dtensor", "strategy.sequence_parallel=true", "trainer.grad_accum=2"],
}


@pytest.fixture(scope="module")
def default_results(request) -> dict[str, list]:
    configs = selected(request, DEFAULT)  # make test: all three; its foreign-dispatch pass: manual-sp-dropout
    return run_configurations(tp_vit_body, configs, world_size=2, timeout=300, steps=STEPS, global_batch=BATCH)


@pytest.fixture(scope="module")
def extra_results() -> dict[str, list]:
    return run_configurations(tp_vit_body, EXTRA, world_size=2, timeout=600, steps=STEPS, global_batch=BATCH)


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(DEFAULT))
def test_tp_vit_is_singles_training_with_the_megatron_bytes(default_results, config):
    assert_every_rank_passed(default_results, config)


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("config", list(EXTRA))
def test_tp_vit_more_configurations(extra_results, config):
    """The rest of the matrix; test_tp_vit_is_singles_training_with_the_megatron_bytes keeps the claim in make test."""
    assert_every_rank_passed(extra_results, config)


@pytest.mark.extra
@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp2_x_tp_on_one_2d_mesh_is_singles_training(cli, accum):
    """torchtitan's 2-D layout, strategy=fsdp strategy.tp=2 at world 4 (slow on 2 cores: extra;
    tests/unit/test_tensor_parallel.py keeps the layout, its refusals and the planner's state and
    bytes against the same derivation in make test, and the split itself is the dtensor one judged
    above): every rank's model state is the planned one and tests/support/fsdp_tp.py's, its bytes
    FSDP's over the tp-local shards plus Megatron's all-reduces (with trainer.grad_accum=2: each
    micro-batch's)."""
    from parallel_lab.models import build_meta_model
    from tests.support.fsdp_tp import fsdp_tp_bytes, fsdp_tp_state
    from tests.support.model_parallel import compose_config
    from tests.support.reference import parity_reference

    steps, batch = 5, 16
    m = cli(
        "model=vit", "strategy=fsdp", "strategy.tp=2", "world_size=4",
        f"trainer.steps={steps}", f"trainer.global_batch={batch}", "trainer.eval_batches=0",
        f"trainer.grad_accum={accum}",
    )  # fmt: skip
    parity_reference("vit", steps=steps, global_batch=batch).assert_run_matches(m, "vit fsdp x tp")
    assert m["strategy_extras"]["mesh"]["dims"] == {"shard": 2, "tp": 2}
    # The replica check by DTensor placement: what is Replicate on tp (the norms) is one copy per shard
    assert m["replica_digests_agree"] is True and m["replica_groups"] == [[0, 1], [2, 3]], m["replica_groups"]
    # fully_shard halves everything, Megatron's split halves the blocks' Linears again: < a half each
    meta = build_meta_model(compose_config("model=vit").model)
    full = 4 * sum(p.numel() for p in meta.parameters())
    assert all(r["param_bytes"] < full / 2 for r in m["ranks"]), [r["param_bytes"] for r in m["ranks"]]
    shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    bytes_ = fsdp_tp_bytes(shapes, 4, 2, 1, batch // 2 // accum, 64, 64, accum)  # 2 data-parallel ranks of 8 samples
    for rank, r in enumerate(m["ranks"]):
        state = fsdp_tp_state(shapes, 4, 2, rank)
        assert state == {key: r[key] for key in state} == {key: r[f"predicted_{key}"] for key in state}, (rank, r)
        assert r["comm_bytes_by_op"] == bytes_, (rank, r["comm_bytes_by_op"], bytes_)
