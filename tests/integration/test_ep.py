"""Expert parallelism on real ranks (strategies/ep/, docs/moe.md): one ddp run with strategy.ep=2
serves every claim: it trains as the independent single-process reference does (aux loss
included, the report's parity criterion), every rank holds the model-state bytes the planner
predicted for it, and the all-to-all bytes each rank issued are what the step's routing implies,
summed over the ranks the formula of the dropless exchange (each token's k copies of h fp32
elements, dispatch and combine, forward and backward). An FSDP2 run and a tp x ep run on 4 ranks
(Adam, evaluation at the end) make the same claims, and so do zero2 and zero0 (trained in the ddp run's
ranks), which run DeepSpeed's own MoE layer with its padded exchange (strategies/zero/ds_moe.py).
The MoE gpt under fsdp and zero2, in the same ranks, makes the same claims (ddp's: test_cp_vit.py).
Refusals: one line, exit 2, in the parent.
The layer in one process: tests/unit/test_moe.py."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from parallel_lab.cli.run import load_metrics, run_ranks
from tests.support.bodies.ep import train_and_count_ep_activations
from tests.support.checks import assert_plan_matches
from tests.support.cli import assert_one_clean_line, run_cli, write_config
from tests.support.reference import GPT_MOE, GPT_RUN, GPT_SIZES, VIT_MOE, parity_reference

STEPS, BATCH, K, DIM, TOKENS, MOE_LAYERS = 3, 16, VIT_MOE["moe_topk"], 64, (32 // VIT_MOE["patch"]) ** 2, 1
MOE = ["model=vit", *(f"model.{key}={value}" for key, value in VIT_MOE.items())]
# eval_batches=0: the end-of-run evaluation (whose all-to-alls are outside any step) is not what
# these claims are about; the default path's evaluation runs in test_ep_strategies_run_to_the_end.
RUN = [*MOE, f"trainer.steps={STEPS}", f"trainer.global_batch={BATCH}", "trainer.eval_batches=0"]
# SGD: under Adam an expert gradient N times too large (summed over the ep group, not averaged)
# changes almost nothing (Adam divides by the gradient's own scale); under SGD it shows at once.
SGD = "trainer.optimizer=sgd"
DS_ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))}


def run(tmp_path_factory, name: str, *overrides: str) -> dict:
    run_dir = tmp_path_factory.mktemp("ep") / name
    run_cli(run_dir, *overrides)
    return {**load_metrics(run_dir), "run_dir": str(run_dir)}


# zero0-2 run DeepSpeed's own MoE layer (strategies/zero/ds_moe.py); zero2 and zero0 (~1 s more)
# train in the ddp run's set of ranks, after it (tests/support/bodies/runs.py): one launch. zero1
# (make test-all) adds a launch.
SHARED = {name: (f"strategy={name}", "strategy.ep=2", "world_size=2", SGD, *RUN) for name in ("ddp", "zero2", "zero0")}
# pp trains in the same ranks too: the MoE block (block1) cut onto the first stage, the loss on the last
PP_MOE = ("strategy=pp", "strategy.stages=2", "strategy.cuts=[head]", "world_size=2", SGD, *RUN)
# The MoE gpt (block 1 of 2 an MoE MLP, tests/support/reference.py) under fsdp and zero2, in the
# same ranks: its own claims beside the ddp ones of tests/support/bodies/cp_gpt.py check_gpt_ep
GPT_MOE_RUN = [*GPT_RUN, *(f"model.{key}={value}" for key, value in GPT_MOE.items()), *RUN[len(MOE) :]]
GPT_EP = {f"gpt_{s}": (f"strategy={s}", "strategy.ep=2", "world_size=2", SGD, *GPT_MOE_RUN) for s in ("fsdp", "zero2")}
# FSDP2 x ep with the default optimizer (Adam) and evaluation, trained last in the same ranks: a
# claim about the strategy, not the command line (which every other CLI test runs)
FSDP_EP = (
    "strategy=fsdp",
    "strategy.ep=2",
    "world_size=2",
    *MOE,
    f"trainer.steps={STEPS}",
    f"trainer.global_batch={BATCH}",
)
SEQ, HIDDEN, GPT_MOE_LAYERS = GPT_SIZES["seq"], GPT_SIZES["hidden"], GPT_SIZES["layers"] // 2  # moe_every=2


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("ep_shared")
    runs = {**SHARED, "pp": PP_MOE, **GPT_EP, "fsdp": FSDP_EP}
    paths = [write_config(root / f"{name}.yaml", *overrides) for name, overrides in runs.items()]
    outputs = run_ranks(train_and_count_ep_activations, world_size=2, timeout=600, env=DS_ENV, config_paths=paths)
    counted = [json.loads(out.strip().splitlines()[-1]) for out in outputs]  # the zero runs' saved bytes, per rank
    return {
        name: {
            **load_metrics(root / name),
            "run_dir": str(root / name),
            "saved": [c.get(str(root / name)) for c in counted],
        }
        for name in runs
    }


@pytest.fixture(scope="module")
def shared_ep(shared_runs) -> dict[str, dict]:
    return {name: shared_runs[name] for name in SHARED}


@pytest.fixture(scope="module")
def ddp_ep(shared_ep) -> dict:
    return shared_ep["ddp"]


@pytest.fixture(scope="module")
def zero1_ep(tmp_path_factory) -> dict:
    return run(tmp_path_factory, "zero1", "strategy=zero1", "strategy.ep=2", "world_size=2", SGD, *RUN)


def zero_ep_run(request, name: str) -> dict:
    return request.getfixturevalue("shared_ep")[name] if name in SHARED else request.getfixturevalue(f"{name}_ep")


ZERO_EP = ["zero2", "zero0", pytest.param("zero1", marks=pytest.mark.extra)]


@pytest.fixture(scope="module")
def fsdp_ep(shared_runs) -> dict:
    """FSDP2 with the default optimizer (Adam) and the default end-of-run evaluation (FSDP_EP)."""
    return shared_runs["fsdp"]


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.floats
def test_dropless_ep_trains_as_single_does_aux_loss_included(ddp_ep):
    reference = parity_reference("vit_moe", optimizer="sgd", steps=STEPS, global_batch=BATCH, threads=1)
    reference.assert_run_matches(ddp_ep, "ddp ep=2")


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.floats
def test_pp_backpropagates_the_load_balancing_loss_of_every_stage(shared_runs):
    """The MoE block on stage 0, the loss on stage 1: each stage adds its own blocks' aux loss to
    what it backpropagates and the logged loss is the sum (pp/manual.py), so pp trains as single
    does (without: step 0's loss lacks stage 0's aux loss, its router lacks that gradient)."""
    metrics = shared_runs["pp"]
    assert metrics["strategy_options"]["cuts"] == ["head"]
    reference = parity_reference("vit_moe", optimizer="sgd", steps=STEPS, global_batch=BATCH, threads=1)
    reference.assert_run_matches(metrics, "pp, the MoE block on stage 0")


TP_EP = (
    "strategy=tp",
    "strategy.ep=2",
    "world_size=4",
    *MOE,
    f"trainer.steps={STEPS}",
    f"trainer.global_batch={BATCH}",
)


# HSDP x ep: fully_shard over replicate 2 x shard 2, ep=2 inside each shard group (torchtitan's
# layout: ep borrows the shard ranks), each expert's replicas across the replicate dim. SGD: an
# expert gradient reduced over the wrong ranks or divided by the wrong count shows at once.
HSDP_EP = ("strategy=fsdp", "strategy.sharding=hybrid", "strategy.replicate=2", "strategy.ep=2", "world_size=4",
           SGD, *RUN)  # fmt: skip


# FSDP2 x TP x EP: Megatron's DTensor split of each block's attention inside the tp pairs {0, 1},
# {2, 3} (an MoE block's MLP whole on both), fully_shard over the shard ranks {0, 2}, {1, 3}, which
# are also the ep groups; the experts outside fully_shard. SGD, as HSDP_EP.
FSDP_TP_EP = ("strategy=fsdp", "strategy.tp=2", "strategy.ep=2", "world_size=4", SGD, *RUN)


@pytest.fixture(scope="module")
def world4_ep(tmp_path_factory) -> dict[str, dict]:
    """The 4-rank runs, trained in turn in 4 ranks of their own (one start-up)."""
    runs = {"tp": TP_EP, "hsdp": HSDP_EP, "fsdp_tp": FSDP_TP_EP}
    return ranks_of_their_own(tmp_path_factory, runs, world_size=4)


@pytest.fixture(scope="module")
def fsdp_tp_ep(world4_ep) -> dict:
    return world4_ep["fsdp_tp"]


@pytest.fixture(scope="module")
def tp_ep(world4_ep) -> dict:
    """tp=2 inside each of 2 replicas (replicate widened from 1 by ep), ep=2 across them; Adam,
    evaluation; its ranks then count what a forward saves."""
    return world4_ep["tp"]


@pytest.fixture(scope="module")
def hsdp_ep(world4_ep) -> dict:
    return world4_ep["hsdp"]


def ranks_of_their_own(tmp_path_factory, runs: dict[str, tuple], world_size: int) -> dict[str, dict]:
    """Runs through the worker's loop in turn in one set of ranks of their own
    (tests/support/bodies/ep.py), with each rank's saved bytes of one forward under the planner's
    balanced routing (tp and zero runs)."""
    root = tmp_path_factory.mktemp("ep_own")
    paths = [write_config(root / f"{name}.yaml", *overrides) for name, overrides in runs.items()]
    outputs = run_ranks(train_and_count_ep_activations, world_size=world_size, timeout=600, config_paths=paths)
    counted = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    return {
        name: {
            **load_metrics(root / name),
            "run_dir": str(root / name),
            "saved": [c.get(str(root / name)) for c in counted],
        }
        for name in runs
    }


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.floats
@pytest.mark.parametrize("name", ["fsdp_ep", "tp_ep"])
def test_fsdp_and_tp_with_ep_train_as_single_does_and_evaluate(request, name):
    metrics = request.getfixturevalue(name)
    reference = parity_reference("vit_moe", steps=STEPS, global_batch=BATCH, threads=1)
    reference.assert_run_matches(metrics, name)
    assert metrics["eval_accuracy"] is not None  # the evaluation's forwards exchange tokens too


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.floats
def test_hsdp_with_ep_trains_as_single_does(hsdp_ep):
    """HSDP's dense gradients averaged over shard then replicate, each expert's summed over its ep
    group's samples and its replicas (the other replica group's ranks), / dp: single's SGD training."""
    assert hsdp_ep["strategy_extras"]["mesh"]["dims"] == {"replicate": 2, "shard": 2}
    reference = parity_reference("vit_moe", optimizer="sgd", steps=STEPS, global_batch=BATCH, threads=1)
    reference.assert_run_matches(hsdp_ep, "fsdp hybrid replicate=2 ep=2")


@pytest.mark.slow
def test_hsdp_with_ep_comm_is_hsdps_and_the_experts_reduction_and_the_routings(hsdp_ep):
    """Every rank: the dense parameters' gathers and reduce-scatter over its shard group and the
    all-reduce of their shard over the replicas, as the planner predicts them to the byte; the
    experts' all-reduce over the 2 ranks holding them, 2 x their fp32 bytes; the all-to-all bytes
    its routing's, over the ranks the dropless 4 x B x S x k x h x 4; theory = measured."""
    from parallel_lab.config import load_run_config
    from parallel_lab.models import build_meta_model
    from parallel_lab.models.moe import moe_layers
    from parallel_lab.strategies import get_strategy_class

    cfg = load_run_config(hsdp_ep["run_dir"] + ".yaml")
    meta = build_meta_model(cfg.model)
    experts = sum(p.numel() for moe in moe_layers(meta) for p in moe.experts.parameters()) // 2  # E / ep a rank
    for rank, measured in enumerate(hsdp_ep["ranks"]):
        planned = get_strategy_class("fsdp").plan.predict_comm(cfg, meta, rank)
        for op in ("all_gather_single", "reduce_scatter_single", "all_reduce"):  # the counts' all-gather: ep x E int64
            assert measured["comm_bytes_by_op"][op] == planned[op], (rank, op, measured["comm_bytes_by_op"], planned)
        groups = measured["comm_bytes_by_group"]
        assert groups["ep_replicas"] == 2 * 4 * experts, rank
        assert groups["replicate"] == planned["all_reduce"] - 2 * 4 * experts, rank
    theory = hsdp_ep["strategy_extras"]["ep"]["theory_bytes_per_step"]
    assert hsdp_ep["ranks"][0]["comm_bytes_by_op"]["all_to_all_single"] == theory["all_to_all_single"]
    total = sum(r["comm_bytes_by_op"]["all_to_all_single"] for r in hsdp_ep["ranks"])
    assert total == MOE_LAYERS * 4 * BATCH * TOKENS * K * DIM * 4, total
    assert hsdp_ep["comm_theory_psi"] == pytest.approx(hsdp_ep["comm_volume_psi"], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.floats
def test_fsdp_x_tp_x_ep_trains_as_single_does(fsdp_tp_ep):
    """Each expert's gradient summed over its ep group's samples (its replica: itself) / dp, the same
    on both tp ranks (the MoE MLP whole on each); the dense ones fully_shard's over the shard ranks
    of Megatron's split: single's SGD training."""
    assert fsdp_tp_ep["strategy_extras"]["mesh"]["dims"] == {"shard": 2, "tp": 2}
    reference = parity_reference("vit_moe", optimizer="sgd", steps=STEPS, global_batch=BATCH, threads=1)
    reference.assert_run_matches(fsdp_tp_ep, "fsdp tp=2 ep=2")


@pytest.mark.slow
def test_fsdp_x_tp_x_ep_comm_state_and_activations_are_the_formulas(fsdp_tp_ep):
    """Every rank: fully_shard's 2 all-gathers and 1 reduce-scatter of the tp-local padded shards over
    its shard pair, derived here from the shapes (q, k, v and a dense block's fc1 by rows, proj and
    fc2 by columns over tp, everything else whole); Megatron's all-reduces, 4 of the (b, S, h) activation a
    dense block and 2 an MoE block; no expert all-reduce (one rank per expert replica group); the
    all-to-all its routing's, over the 2 ranks of each tp coordinate the dropless
    4 x B x S x k x h x 4; theory = measured; the state and the activations the planner's."""
    from parallel_lab.config import load_run_config
    from parallel_lab.models import build_meta_model
    from parallel_lab.models.moe import moe_layers

    cfg = load_run_config(fsdp_tp_ep["run_dir"] + ".yaml")
    meta = build_meta_model(cfg.model)
    experts = {id(p) for moe in moe_layers(meta) for p in moe.experts.parameters()}
    local = 0  # a tp rank's elements of the dense parameters, each padded as fully_shard pads dim 0 over 2
    for name, p in meta.named_parameters():
        shape = list(p.shape)
        if any(f".{c}." in name for c in ("attn.q", "attn.k", "attn.v", "mlp.fc1")):
            shape[0] //= 2  # column parallel: its rows split (an expert's fc1 is mlp.experts.i.fc1)
        elif name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
            shape[1] //= 2  # row parallel: its columns split (its bias whole)
        local += 0 if id(p) in experts else -(-shape[0] // 2) * 2 * math.prod(shape[1:])
    act, moe = (BATCH // 2) * TOKENS * DIM * 4, len(moe_layers(meta))
    reduces = 4 * (VIT_MOE["depth"] - moe) + 2 * moe  # an MoE block's MLP splits nothing
    for rank, measured in enumerate(fsdp_tp_ep["ranks"]):
        ops = measured["comm_bytes_by_op"]
        assert ops["all_gather_single"] == 2 * 4 * local + MOE_LAYERS * 2 * 4 * 8, (rank, ops, local)
        assert ops["reduce_scatter_single"] == 4 * local, (rank, ops)
        assert ops["all_reduce"] == reduces * 2 * act, (rank, ops)  # an all-reduce of B counts 2B
        assert "ep_replicas" not in measured["comm_bytes_by_group"], rank
    theory = fsdp_tp_ep["strategy_extras"]["ep"]["theory_bytes_per_step"]
    assert fsdp_tp_ep["ranks"][0]["comm_bytes_by_op"]["all_to_all_single"] == theory["all_to_all_single"]
    for tp_rank in (0, 1):  # each tp coordinate's ep group exchanges the whole batch's copies
        total = sum(r["comm_bytes_by_op"]["all_to_all_single"] for r in fsdp_tp_ep["ranks"][tp_rank::2])
        assert total == MOE_LAYERS * 4 * BATCH * TOKENS * K * DIM * 4, (tp_rank, total)
    assert fsdp_tp_ep["comm_theory_psi"] == pytest.approx(fsdp_tp_ep["comm_volume_psi"], rel=1e-12)
    assert_plan_matches(fsdp_tp_ep, tolerance=0.0)
    assert_saved_as_planned(fsdp_tp_ep)


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.floats
@pytest.mark.parametrize("name", ZERO_EP)
def test_zero_with_ep_runs_deepspeeds_moe_layer_and_trains_as_single_does(request, name):
    """DeepSpeed's layer, dropless, one call per sample, its l_aux in the loss: the same training
    (zero1: DeepSpeed's contiguous-gradient path; its other one scales expert gradients ep times)."""
    metrics = zero_ep_run(request, name)
    assert metrics["strategy_extras"]["ep"]["layer"] == "deepspeed.moe.layer.MoE"
    reference = parity_reference("vit_moe", optimizer="sgd", steps=STEPS, global_batch=BATCH, threads=1)
    reference.assert_run_matches(metrics, f"{name} ep=2")


@pytest.mark.slow
@pytest.mark.parametrize("name", ZERO_EP)
def test_zero_with_ep_comm_is_deepspeeds_padded_exchange_and_its_reductions(request, name):
    """Per sample and MoE layer four all-to-alls of DeepSpeed's E x C x h buffer (C: the largest
    count, at least ceil(k S / E)) and the capacity's all-reduce; the dense group's all-reduce and
    all-gather, the experts' all-reduce over their (one-rank) expert-data-parallel group; every
    rank's model state as the planner predicted, to the byte."""
    metrics = zero_ep_run(request, name)
    assert_plan_matches(metrics, tolerance=0.0)
    theory = metrics["strategy_extras"]["ep"]["theory_bytes_per_step"]
    measured = metrics["ranks"][0]["comm_bytes_by_op"]
    assert measured["all_to_all_single"] == theory["all_to_all_single"]
    least = MOE_LAYERS * BATCH // 2 * 4 * 4 * -(-K * TOKENS // 4) * DIM * 4  # E = 4 experts, balanced
    assert theory["all_to_all_single"] >= least
    assert theory["all_reduce"] == MOE_LAYERS * BATCH // 2 * 16
    # the report's comm Ψ meas/theory: DeepSpeed's few scalar all-reduces (24 bytes a step) are outside the theory
    extra = (metrics["comm_volume_psi"] - metrics["comm_theory_psi"]) * 4 * metrics["params"]
    assert 0 <= extra <= 24 + 1e-6, extra


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.floats
@pytest.mark.parametrize("name", list(GPT_EP))
def test_the_moe_gpt_under_fsdp_and_zero2_ep_trains_as_single_does_with_the_planned_state(shared_runs, name):
    """The MoE gpt (token cross-entropy plus the aux loss) under FSDP2 (the experts outside
    fully_shard) and under zero2 (DeepSpeed's MoE layer): SGD parity with the single reference,
    every rank's model state the planner's to the byte, half the experts a rank."""
    metrics = shared_runs[name]
    reference = parity_reference("gpt_moe", optimizer="sgd", steps=STEPS, global_batch=BATCH, threads=1)
    reference.assert_run_matches(metrics, f"gpt {name} ep=2")
    assert_plan_matches(metrics, tolerance=0.0)
    if name == "gpt_zero2":  # the dense parameters whole, half the experts (fsdp: both halved)
        assert metrics["strategy_extras"]["ep"]["layer"] == "deepspeed.moe.layer.MoE"
        assert all(r["param_bytes"] < r["analytic_param_bytes"] for r in metrics["ranks"]), metrics["ranks"]


@pytest.mark.slow
def test_pp_with_the_moe_block_stashes_the_planned_activations(shared_runs):
    """Each stage's activation peak (pp/activations.py, the last step) is the planner's count of its
    chunk under the schedule, the MoE block's experts an equal share of the copies (dropless: all
    the copies whatever the routing)."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class
    from tests.support.model_parallel import compose_config

    cfg = compose_config(*PP_MOE)
    plans = plan_world(cfg, get_strategy_class("pp"), build_meta_model(cfg.model))
    measured = shared_runs["pp"]["strategy_extras"]["pp_activation_peak_bytes"]
    assert measured == [plan.activation_bytes for plan in plans], (measured, [p.activation_bytes for p in plans])


@pytest.mark.slow
def test_tp_with_ep_saves_the_planned_activations_on_every_rank(tp_ep):
    """Each rank's split vit with its E / ep experts behind the exchanges (the MoE MLP whole on every
    tp rank) saves, routing every expert an equal share (tests/support/activations.py
    balanced_routing), what the planner counts on its meta copy (tp/rules.py activation_bytes)."""
    assert_saved_as_planned(tp_ep)


@pytest.mark.slow
def test_hsdp_with_ep_saves_the_planned_activations_on_every_rank(hsdp_ep):
    """HSDP x ep: each rank's real forward through fully_shard's units (its gathered weights
    counted as the parameters they are while registered, tests/support/bodies/ep.py), its E / ep
    experts behind the exchanges under balanced_routing, saves what the planner counts on the
    whole model's meta copy with the rank's experts (fsdp/rules.py activation_bytes)."""
    assert_saved_as_planned(hsdp_ep)


def assert_saved_as_planned(metrics: dict) -> None:
    from parallel_lab.config import load_run_config
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class

    cfg = load_run_config(metrics["run_dir"] + ".yaml")
    plans = plan_world(cfg, get_strategy_class(cfg.strategy.name), build_meta_model(cfg.model))
    assert metrics["saved"] == [plan.activation_bytes for plan in plans], cfg.strategy.name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "zero0", "gpt_zero2"])
def test_deepspeeds_moe_layer_saves_the_planned_activations_on_every_rank(shared_runs, name):
    """What one training forward and loss of DeepSpeed's MoE layer save on each rank (its gate's
    softmax and masks, its E x C x h buffers, the rank's experts on them, the combine), DeepSpeed's
    gate routing every expert an equal share (tests/support/activations.py
    balanced_deepspeed_routing): the planner's meta forward of the same layer
    (zero/ds_moe_plan.py), not the model's own layer's count."""
    assert_saved_as_planned(shared_runs[name])


@pytest.mark.slow
def test_the_moe_gpt_under_fsdp_and_zero2_ep_exchanges_the_formulas_bytes(shared_runs):
    """fsdp: each rank's all-to-all bytes are its routing's and over the ranks the dropless
    4 x B x seq x k x h x 4 a MoE layer, beside fully_shard's padded 3Ψ of the dense parameters;
    zero2: DeepSpeed's four all-to-alls a sample of its E x C x h buffer (C at least ceil(k seq / E))
    and one int64 all-reduce of the capacity a sample. Both: the report's comm Ψ theory."""
    fsdp, zero2 = shared_runs["gpt_fsdp"], shared_runs["gpt_zero2"]
    for metrics in (fsdp, zero2):  # rank 0's routing (its strategy_extras) and rank 0's counted bytes
        theory = metrics["strategy_extras"]["ep"]["theory_bytes_per_step"]
        assert metrics["ranks"][0]["comm_bytes_by_op"]["all_to_all_single"] == theory["all_to_all_single"]
    assert theory["all_to_all_single"] >= GPT_MOE_LAYERS * BATCH // 2 * 4 * 4 * -(-K * SEQ // 4) * HIDDEN * 4
    assert theory["all_reduce"] == GPT_MOE_LAYERS * BATCH // 2 * 16
    total = sum(r["comm_bytes_by_op"]["all_to_all_single"] for r in fsdp["ranks"])
    assert total == GPT_MOE_LAYERS * 4 * BATCH * SEQ * K * HIDDEN * 4, total
    assert fsdp["comm_theory_psi"] == pytest.approx(fsdp["comm_volume_psi"], rel=1e-12)
    extra = (zero2["comm_volume_psi"] - zero2["comm_theory_psi"]) * 4 * zero2["params"]
    assert 0 <= extra <= 24 + 1e-6, extra


@pytest.mark.slow
def test_each_rank_holds_the_expert_state_the_planner_predicted_to_the_byte(shared_ep, fsdp_ep, tp_ep, hsdp_ep):
    for metrics in (*shared_ep.values(), fsdp_ep, tp_ep, hsdp_ep):
        assert_plan_matches(metrics, tolerance=0.0)
    ranks = shared_ep["ddp"]["ranks"]
    assert ranks[0]["param_bytes"] < ranks[0]["analytic_param_bytes"]  # half of the experts each


@pytest.mark.slow
def test_all_to_all_bytes_are_the_routings_and_the_dropless_formula(ddp_ep):
    """Rank 0's measured bytes equal what its routing implied; over both ranks, every token's k
    copies are sent and received, forward and backward: 4 x B x S x k x h x 4 bytes per MoE layer."""
    theory = ddp_ep["strategy_extras"]["ep"]["theory_bytes_per_step"]
    measured = ddp_ep["ranks"][0]["comm_bytes_by_op"]
    assert measured["all_to_all_single"] == pytest.approx(theory["all_to_all_single"], rel=1e-12)
    assert measured["all_gather_single"] == theory["all_gather_single"] == MOE_LAYERS * 2 * 4 * 8
    total = sum(r["comm_bytes_by_op"]["all_to_all_single"] for r in ddp_ep["ranks"])
    assert total == pytest.approx(MOE_LAYERS * 4 * BATCH * TOKENS * K * DIM * 4, rel=1e-12)
    # the report's "comm Ψ meas/theory": both numbers, equal
    assert ddp_ep["comm_theory_psi"] == pytest.approx(ddp_ep["comm_volume_psi"], rel=1e-12)


@pytest.mark.slow
def test_fsdp_and_tp_comm_is_their_own_and_the_routings_exchanges(fsdp_ep, tp_ep):
    """fsdp: its padded gathers and reduce-scatter; tp: Megatron's all-reduces (none for an MoE
    block's MLP, which stays whole) and the replicas' average of the dense gradients."""
    for metrics in (fsdp_ep, tp_ep):
        theory = metrics["strategy_extras"]["ep"]["theory_bytes_per_step"]
        assert metrics["ranks"][0]["comm_bytes_by_op"]["all_to_all_single"] == pytest.approx(
            theory["all_to_all_single"]
        )
        assert metrics["comm_theory_psi"] == pytest.approx(metrics["comm_volume_psi"], rel=1e-12)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["strategy=ddp", "strategy.ep=3", "world_size=3"], "strategy.ep=3 does not divide model.moe_experts=4"),
        (["strategy=ddp", "strategy.ep=4", "world_size=2"], "strategy.ep=4 does not divide the data-parallel size 2"),
        (["strategy=ddp", "strategy.ep=2", "world_size=2", "trainer.grad_clip=1"], "trainer.grad_clip=1.0"),
        (["strategy=fsdp", "strategy.ep=2", "strategy.sharding=grad_op"], "sharding=grad_op"),
        (["strategy=zero3", "strategy.ep=2"], "DeepSpeed refuses MoE under ZeRO-3"),
        (["strategy=zero2", "strategy.ep=2", "model.moe_topk=3"], "model.moe_topk=3"),
        (["strategy=zero2", "strategy.ep=2", "model.moe_capacity_factor=1.25"], "model.moe_capacity_factor=1.25"),
        (["strategy=tp", "strategy.ep=2", "world_size=4", "strategy.sequence_parallel=true"], "sequence parallelism"),
    ],
)
def test_refusals_are_one_line_in_the_parent(tmp_path, overrides, named):
    result = run_cli(tmp_path / "run", *MOE, *overrides, check=False, timeout=120)
    assert result.returncode == 2
    assert_one_clean_line(result, tmp_path / "run", named)


def test_ep_without_moe_layers_is_refused(tmp_path):
    result = run_cli(tmp_path / "run", "strategy=ddp", "strategy.ep=2", "model=vit", check=False, timeout=120)
    assert result.returncode == 2
    assert_one_clean_line(result, tmp_path / "run", "strategy.ep=2 shards MoE experts")
