"""Tensor parallelism (strategy=tp): bad input is one config error, refused in the parent,
in-process. The strategy on real ranks: tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from tests.support.model_parallel import assert_one_line_config_error, compose_config

GPT = ["model=gpt", "data=tokens"]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["strategy.tp=3", "world_size=3", "strategy.split_conv=true"], ["strategy.tp=3", "32", "block1.0"]),
        (["strategy.tp=4", "world_size=2"], ["strategy.tp=4", "world_size=2"]),
        (["strategy.impl=megatron"], ["strategy.impl=megatron"]),
        (["strategy.impl=dtensor", "strategy.split_conv=true"], ["strategy.split_conv=true"]),
        # the vit's Megatron split (tp/megatron.py): whole heads, whole hidden features, whole tokens
        (["model=vit", "model.heads=2", "strategy.tp=4", "world_size=4"], ["strategy.tp=4", "model.heads=2"]),
        (["model=vit", "model.heads=3", "model.dim=48", "strategy.tp=2"], ["strategy.tp=2", "model.heads=3"]),
        (["model=vit", "model.mlp_ratio=1.5", "model.dim=34", "model.heads=2"], ["51", "mlp.fc1"]),
        (["model=vit", "strategy.sequence_parallel=true", "strategy.tp=1", "world_size=1"], ["strategy.tp=1"]),
        (["strategy.sequence_parallel=true"], ["model=cnn", "strategy.sequence_parallel=false"]),
        (
            ["model=vit", "model.patch=32", "strategy.sequence_parallel=true", "strategy.tp=2"],
            ["1 tokens", "model.patch=32"],
        ),
        (
            ["model=vit", "model.dropout=0.1", "strategy.impl=dtensor", "strategy.sequence_parallel=true"],
            ["strategy.impl=manual", "DTensor"],
        ),
        # the gpt's split (tp/gpt_rules.py): whole query and key/value heads, hidden features, vocabulary rows, tokens
        ([*GPT, "model.kv_heads=1"], ["strategy.tp=2", "model.kv_heads=1", "key/value heads"]),
        ([*GPT, "model.heads=2", "strategy.tp=4", "world_size=4"], ["strategy.tp=4", "model.heads=2"]),
        ([*GPT, "model.ffn=255"], ["strategy.tp=2", "model.ffn=255"]),
        ([*GPT, "model.vocab=257"], ["strategy.tp=2", "model.vocab=257", "vocabulary rows"]),
        ([*GPT, "model.seq=63", "strategy.sequence_parallel=true"], ["strategy.tp=2", "model.seq=63"]),
        ([*GPT, "strategy.sequence_parallel=true", "strategy.tp=1", "world_size=1"], ["strategy.tp=1"]),
        ([*GPT, "strategy.impl=dtensor"], ["strategy.impl=dtensor", "model=gpt", "use strategy.impl=manual"]),
    ],
)
def test_tp_bad_input_is_one_config_error(overrides, named):
    assert_one_line_config_error("tp", overrides, named)


def test_sequence_parallel_plans_the_token_regions_divided_by_tp():
    """The planner's activations (a meta copy split as the run splits it; tests/integration/
    test_tp_vit.py checks them against a real forward): under sequence parallelism each LayerNorm
    (2 per block, the head's) saves its input and its mean and rstd for tokens/tp only, and the column
    layers save their input's shard (2 per block), as Megatron does: that is the whole difference.
    Its communication equals plain tp's plus the embedding's gather, the column inputs gathered
    again in backward (2 per block), the pool and the LayerNorm gradient sums."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class

    def plan(*overrides):
        cfg = compose_config("model=vit", "world_size=2", "trainer.global_batch=8", *overrides)
        return plan_world(cfg, get_strategy_class(cfg.strategy.name), build_meta_model(cfg.model))[0]

    tp, sp = plan("strategy=tp"), plan("strategy=tp", "strategy.sequence_parallel=true")
    batch, tokens, dim, norms = 8, 64, 64, 2 * 4 + 1
    per_norm = 4 * (batch * tokens * dim + 2 * batch * tokens)  # input, mean, rstd (fp32)
    a = 8 * 64 * 64 * 4  # one (batch, tokens, dim) fp32 activation
    assert tp.activation_bytes - sp.activation_bytes == norms * per_norm // 2 + 2 * 4 * a // 2
    assert tp.comm == {"all_reduce": 4 * 2 * 2 * 2 * a}
    assert sp.comm["all_gather_single"] + sp.comm["reduce_scatter_single"] == tp.comm["all_reduce"] + a + 2 * 4 * a


def test_fsdp_tp_lays_out_one_shard_x_tp_mesh():
    """strategy=fsdp strategy.tp=2 at world 4: one (shard 2, tp 2) mesh; the tp ranks of a
    data-parallel rank read the same samples. Refused in one line: another model, another
    sharding, heads the degree does not divide. Trained: tests/integration/test_tp_vit.py (extra)."""
    from parallel_lab.strategies.fsdp.rules import FSDPPlan

    cfg = compose_config("model=vit", "strategy=fsdp", "strategy.tp=2", "world_size=4")
    dims = FSDPPlan.dims(cfg)
    assert (dims.shard, dims.tp, dims.replicate) == (2, 2, 1)
    assert [dims.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert FSDPPlan.data_parallel_size(cfg) == 2
    for overrides, named in (
        (["model=cnn"], ["model=vit", "strategy.tp=1"]),
        (["model=vit", "strategy.sharding=grad_op"], ["strategy.sharding=full"]),
        (["model=vit", "model.heads=3", "model.dim=48"], ["model.heads=3"]),
    ):
        assert_one_line_config_error("fsdp", ["strategy.tp=2", "world_size=4", *overrides], named)


@pytest.mark.parametrize("cp, accum", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_fsdp_tp_plans_each_ranks_state_and_bytes_as_derived_from_the_shapes(cp, accum):
    """strategy=fsdp strategy.tp=2 (strategy.cp=2) at world 4: the planner's model state of every
    rank and its bytes equal tests/support/fsdp_tp.py's derivation from the vit's shapes (the
    runs measure the same: test_tp_vit.py, test_cp_vit.py, extra); cp's attention: cp_vit.py's.
    trainer.grad_accum=2: FSDP's gathers and reductions and Megatron's all-reduces per micro-batch."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class
    from tests.support.bodies.cp_vit import cp_bytes
    from tests.support.fsdp_tp import fsdp_tp_bytes, fsdp_tp_state

    batch, world, tp = 16, 4, 2
    cfg = compose_config("model=vit", "strategy=fsdp", f"strategy.cp={cp}", "strategy.tp=2", f"world_size={world}",
                         f"trainer.global_batch={batch}", f"trainer.grad_accum={accum}")  # fmt: skip
    meta = build_meta_model(cfg.model)
    shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    samples = batch // accum // (world // (cp * tp))  # a data-parallel rank's micro-batch (cp, tp ranks: the same)
    want = fsdp_tp_bytes(shapes, world, tp, cp, samples, 64, 64, accum)
    if cp > 1:
        attention = cp_bytes("ring", cp, samples, accum, tp)
        want = {op: want.get(op, 0.0) + attention.get(op, 0.0) for op in {**want, **attention}}
    plans = plan_world(cfg, get_strategy_class("fsdp"), meta)
    assert len(plans) == world
    for rank, plan in enumerate(plans):
        state = {key: plan.state[key] for key in ("param_bytes", "grad_bytes", "optim_bytes")}
        assert state == fsdp_tp_state(shapes, world, tp, rank), (rank, state)
        assert plan.comm == want, (rank, plan.comm, want)
    # the step-time model's compute: a tp rank's share of the FLOPs as strategy=tp's split computes
    # it, and with cp its tokens' share of that (tests/unit/test_plantime.py derives it)
    tp_cfg = compose_config("model=vit", "strategy=tp", "strategy.tp=2", "world_size=2")
    tp_share = get_strategy_class("tp").plan.compute_shape(tp_cfg, meta).flop_share
    share = get_strategy_class("fsdp").plan.compute_shape(cfg, meta).flop_share
    assert share == pytest.approx(tp_share, rel=1e-12) if cp == 1 else share < tp_share / 1.9


def test_the_command_line_refuses_sequence_parallel_without_tp_with_exit_2(tmp_path):
    """In the parent (in-process), one line, exit 2, no run folder."""
    from tests.support.cli import assert_one_clean_line, run_cli

    run_dir = tmp_path / "run"
    overrides = ("model=vit", "strategy=tp", "strategy.tp=1", "world_size=1", "strategy.sequence_parallel=true")
    result = run_cli(run_dir, *overrides, check=False, timeout=120)
    assert_one_clean_line(result, run_dir, "strategy.sequence_parallel=true needs strategy.tp > 1")
    assert result.returncode == 2 and not run_dir.exists()


@pytest.mark.parametrize("sp", [False, True])
def test_each_rank_plans_only_its_slice_of_the_dropout_masks(sp):
    """model.dropout=0.1 adds, per rank: the embedding's whole bool mask; per block the attention
    core's mask and dropped probabilities (1 + 4 bytes) for its heads/tp, mlp.drop1's mask for its
    hidden/tp, and the two output dropouts' masks, whole or (SP) for tokens/tp: the planner's count
    (equal to a real forward: tests/integration/test_tp_vit.py) holds slices, not views of whole masks."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class

    def planned(*overrides):
        cfg = compose_config("model=vit", "strategy=tp", "world_size=2", "trainer.global_batch=8", *overrides)
        return plan_world(cfg, get_strategy_class("tp"), build_meta_model(cfg.model))[0].activation_bytes

    b, s, d, heads, hidden, t, depth = 8, 64, 64, 4, 128, 2, 4
    on = f"strategy.sequence_parallel={str(sp).lower()}"
    outputs = b * s * d // (t if sp else 1)
    want = b * s * d + depth * (5 * b * heads // t * s * s + b * s * hidden // t + 2 * outputs)
    assert planned(on, "model.dropout=0.1") - planned(on) == want
