"""DeepSpeed's own parallelism on model=vit, each row judged against the independent single-process
reference (tests/support/reference.py, the report's parity criterion) and the planner's exact
per-rank model-state bytes: ``strategy=pp strategy.impl=deepspeed`` (deepspeed.pipe's
PipelineEngine, pp/ds_pipe.py) and ``strategy=tp strategy.impl=deepspeed`` (AutoTP training,
tp/ds_autotp.py); and DeepSpeed's activation checkpointing (zero/ds_checkpointing.py) on a vit
block against the same block without recomputation."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from parallel_lab.cli.run import run_ranks
from parallel_lab.errors import ConfigError
from tests.support.checks import assert_plan_matches
from tests.support.model_parallel import compose_config
from tests.support.reference import parity_reference

STEPS, BATCH = 5, 16  # tests/integration/test_vit.py's runs: its references are shared (lru_cache)
RUN = ("model=vit", "world_size=2", f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}", "trainer.eval_batches=0")
SHORT = ("model=vit", "world_size=2", "trainer.steps=3", "trainer.global_batch=8", "trainer.eval_batches=0")


@pytest.fixture(scope="module")
def reference():
    return parity_reference("vit", steps=STEPS, global_batch=BATCH)


@pytest.fixture(scope="module")
def short_reference():
    """3 steps of 8 samples: a third of the cost of the 5 x 16 reference, for the default suite."""
    return parity_reference("vit", steps=3, global_batch=8)


def check_row(metrics: dict, reference, label: str) -> None:
    assert metrics["model"] == "vit" and len(metrics["losses"]) == len(reference.losses)
    reference.assert_run_matches(metrics, label)
    assert_plan_matches(metrics, tolerance=0.0)


@pytest.mark.slow
@pytest.mark.parity
def test_deepspeed_pipeline_trains_the_vit_as_single_does(cli, short_reference):
    """Two stages, 4 micro-batches (DeepSpeed's gradient_accumulation_steps), each stage holding
    exactly its blocks' weights, gradients and Adam state."""
    m = cli("strategy=pp", "strategy.impl=deepspeed", *SHORT)
    check_row(m, short_reference, "vit pp deepspeed")
    extras = m["strategy_extras"]
    assert extras["pp_impl"] == "deepspeed" and extras["pp_ds_config"]["gradient_accumulation_steps"] == 4
    assert extras["pp_stage_layers"] == [["embed", "block0", "block1"], ["block2", "block3", "head"]]
    # Communication as DeepSpeed's engine calls it, per rank and step: the stage's gradients
    # all-reduced over its one-rank data-parallel group (counted as called, 2 x 4 bytes a parameter)
    # and the loss pair (2 fp32) broadcast from the last stage, derived here; every byte as planned
    # but the tensor meta stage 0 sends once, in the first step (under 1 KiB).
    for r, params in zip(m["ranks"], extras["pp_stage_params"]):
        assert r["comm_bytes_by_op"]["all_reduce"] == 2 * 4 * params and r["comm_bytes_by_op"]["broadcast"] == 8, r
    meta = m["comm_bytes_per_step"] - m["comm_planned_psi"] * 4 * m["params"]  # rank 0's, counted - planned
    assert 0 <= round(meta * len(m["losses"])) <= 1024, meta


@pytest.mark.slow
@pytest.mark.parity
def test_deepspeed_autotp_trains_the_vit_as_single_does(cli, short_reference):
    """AutoTP splits q, k, v, fc1 by output features and proj, fc2 by input features: each rank
    holds half of those weights and the gathered model is single's."""
    m = cli("strategy=tp", "strategy.impl=deepspeed", *SHORT)
    check_row(m, short_reference, "vit tp deepspeed")
    split = m["strategy_extras"]["tp_split_layers"]
    assert sorted(set(split.values())) == ["column", "row"] and len(split) == 6 * 4  # 6 Linears per block


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize(
    "overrides",
    [
        ("strategy=pp", "strategy.impl=deepspeed"),
        ("strategy=pp", "strategy.impl=deepspeed", "strategy.microbatches=2", "trainer.grad_accum=2"),
        ("strategy=pp", "strategy.impl=deepspeed", "strategy.microbatches=1"),
        ("strategy=pp", "strategy.impl=deepspeed", "world_size=4", "strategy.replicate=2"),
        ("strategy=tp", "strategy.impl=deepspeed"),
        ("strategy=tp", "strategy.impl=deepspeed", "trainer.grad_accum=2"),
    ],
)
def test_deepspeed_parallel_matrix(cli, reference, overrides):
    """More of the same: accumulation (pp holds the chunks until DeepSpeed's train_batch), one
    micro-batch, dp x pp on 4 ranks, tp, at 5 x 16. In the default suite:
    test_deepspeed_pipeline_trains_the_vit_as_single_does and
    test_deepspeed_autotp_trains_the_vit_as_single_does."""
    run = [o for o in RUN if not any(o.split("=")[0] == x.split("=")[0] for x in overrides)]
    check_row(cli(*run, *overrides), reference, " ".join(overrides))


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("strategy", ["pp", "tp"])
def test_deepspeed_parallel_clips_as_single_does(cli, strategy):
    """trainer.grad_clip: the pp strategy's clip inside train_batch (pp), the tp strategy's
    own clip before engine.step() (tp). In the default suite, unclipped:
    test_deepspeed_pipeline_trains_the_vit_as_single_does, test_deepspeed_autotp_trains_the_vit_as_single_does."""
    clipped = parity_reference("vit", steps=STEPS, global_batch=BATCH, grad_clip=0.05)
    check_row(cli(f"strategy={strategy}", "strategy.impl=deepspeed", "trainer.grad_clip=0.05", *RUN), clipped, strategy)


def test_deepspeed_tp_refusals_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match="strategy.replicate=2 with strategy.impl=deepspeed"):
        compose_config("strategy=tp", "strategy.impl=deepspeed", "model=vit", "world_size=4", "strategy.replicate=2")
    with pytest.raises(ConfigError, match="no AutoTP layer specs for model=resnet18"):
        compose_config("strategy=tp", "strategy.impl=deepspeed", "model=resnet18", "world_size=2")
    with pytest.raises(ConfigError, match="model.dropout=0.1 with strategy=tp strategy.impl=deepspeed"):
        compose_config("strategy=tp", "strategy.impl=deepspeed", "model=vit", "world_size=2", "model.dropout=0.1")


@pytest.mark.floats  # bits against the same block without recomputation, computed in the body
def test_ds_checkpoint_recomputes_a_vit_block_bit_for_bit():
    """DeepSpeed's checkpoint (configured from the ds_config's activation_checkpointing section),
    wired into the vit's recomputed blocks as the zero and DeepSpeed-pipeline strategies wire it, on
    2 real ranks with deepspeed.comm up: the same output and gradients, bit for bit, as the model
    without recomputation (dropout on: the recomputation draws the forward's masks), with torch's
    linear and with ZeRO-3's (``zero3_linear_wrap``, whose bias gradient is a sum in the output
    gradient's memory order: DeepSpeed's reentrant checkpoint failed selective there, k.bias,
    ds_checkpointing.py)."""
    assert _last_line(run_ranks(checkpointed_block_matches_plain, 2, timeout=120)) == {
        f"{mode} {linear}": [] for mode in ("full", "selective") for linear in ("torch", "zero3")
    }


def checkpointed_block_matches_plain(rank: int, world_size: int) -> None:
    """Body: prints, per recompute mode and linear, the names of the tensors that differ (none: a
    pass). The vit (per-sample dropout on) with trainer.recompute=full|selective through the zero
    strategies' wiring (``use_deepspeed_checkpointing``: DeepSpeed's checkpoint in every region)
    against the same model without recomputation, under torch's linear and under the one ZeRO-3
    swaps in for ``torch.nn.functional.linear`` (DeepSpeed's ``zero3_linear_wrap``)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from parallel_lab.models.recompute import set_recompute
    from parallel_lab.models.vit import ViT
    from parallel_lab.strategies.zero.strategy import import_deepspeed, use_deepspeed_checkpointing

    import_deepspeed().init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    torch.manual_seed(rank)
    plain = ViT(depth=2, dropout=0.1, seed=rank)
    x, torch_linear, differ = torch.randn(4, 3, 32, 32), torch.nn.functional.linear, {}
    for mode in ("full", "selective"):
        for linear, function in (("torch", torch_linear), ("zero3", zero3_linear_wrap)):
            recomputed = copy.deepcopy(plain)
            set_recompute(recomputed, mode)
            use_deepspeed_checkpointing(recomputed, {"activation_checkpointing": {"partition_activations": False}})
            assert recomputed.block0.recompute.checkpoint is not plain.block0.recompute.checkpoint
            torch.nn.functional.linear = function  # as ZeRO-3 does (zero/strategy.py restores it at teardown)
            try:
                results = [_forward_backward(module, x) for module in (copy.deepcopy(plain), recomputed)]
            finally:
                torch.nn.functional.linear = torch_linear
            differ[f"{mode} {linear}"] = [n for n, t in results[0].items() if not torch.equal(t, results[1][n])]
    print(json.dumps(differ))


def _forward_backward(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    out = module(x)
    torch.rand(3)  # RNG moves between forward and backward: the recomputation must not see it
    out.square().sum().backward()
    return {"output": out.detach(), **{n: p.grad for n, p in module.named_parameters()}}


def _last_line(outputs: list[str]):
    return json.loads(outputs[0].strip().splitlines()[-1])


@pytest.mark.extra
@pytest.mark.slow
@pytest.mark.floats  # two runs of this test on the same CPU, compared with each other
def test_deepspeed_pipeline_trains_bit_for_bit_as_the_manual_pipeline(cli):
    """DeepSpeed's TrainSchedule sums the micro-batches' gradients in the manual loop's order: the
    same final weights, bit for bit. In the default suite, against single:
    test_deepspeed_pipeline_trains_the_vit_as_single_does."""
    ours, theirs = (cli("strategy=pp", f"strategy.impl={impl}", *RUN) for impl in ("manual", "deepspeed"))
    assert theirs["losses"] == ours["losses"]
    assert theirs["final_param_sha256"] == ours["final_param_sha256"]
