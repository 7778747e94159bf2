"""Pipeline parallelism (strategy=pp), in-process: the schedules' orders, stage planning, and bad
input as one config error. The strategy on real ranks: tests/integration/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest
import torch

from parallel_lab.errors import ConfigError
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.models.flops import layer_flops
from parallel_lab.strategies.pp.activations import SavedTracker
from parallel_lab.strategies.pp.plan import block_costs, plan_stages, stage_shares
from parallel_lab.strategies.pp.schedules import (
    SCHEDULES,
    bubble_fraction,
    gpipe_first_stage_idle,
    gpipe_step_time,
    peak_in_flight,
    play,
    rank_orders,
)
from tests.support.activations import saved_for_backward_bytes
from tests.support.model_parallel import assert_one_line_config_error

MANUAL = list(SCHEDULES)


@pytest.mark.parametrize("schedule", MANUAL)
def test_schedule_orders_are_valid(schedule):
    """Every (chunk, micro-batch) goes forward once then backward once, each chunk's micro-batches
    in order; GPipe stashes all m activations, 1F1B at most p - s on stage s."""
    for p in range(1, 5):
        for v in (1, 2, 3) if schedule == "interleaved_1f1b" else (1,):
            for m in range(p, 3 * p + 1, p) if schedule == "interleaved_1f1b" else range(1, 6):
                for s in range(p):
                    order = SCHEDULES[schedule](m, p, s, v)
                    ops = ("F", "B", "W") if schedule == "zero_bubble" else ("F", "B")
                    for c in range(v):
                        for kind in ops:
                            assert [i for op, k, i in order if op == kind and k == c] == list(range(m))
                    inflight, peak, waiting = set(), 0, set()
                    for op, c, i in order:
                        if op == "F":
                            inflight.add((c, i))
                        elif op == "B":
                            assert (c, i) in inflight, f"{schedule} p={p} m={m} s={s}: backward {c, i} first"
                            inflight.remove((c, i))
                            waiting |= {(c, i)} if schedule == "zero_bubble" else set()
                        else:
                            assert (c, i) in waiting, f"{schedule} p={p} m={m} s={s}: weights {c, i} before B"
                            waiting.remove((c, i))
                        peak = max(peak, len(inflight) + len(waiting))
                    if schedule in ("gpipe", "1f1b"):
                        assert peak == (m if schedule == "gpipe" else min(p - s, m)), (schedule, p, m, s, peak)
                    if schedule == "zero_bubble":  # ZB-H1: until its W, at most p micro-batches (1F1B's stage 0)
                        assert peak <= min(p, m), (p, m, s, peak)


@pytest.mark.parametrize("schedule", [s for s in MANUAL if s != "zero_bubble"])
def test_orders_played_out_idle_the_formula(schedule):
    """Equal chunks, backward twice or once a forward: every rank of the played-out orders idles
    (p-1)/(m+p-1) (gpipe, 1f1b) or (p-1)/(v m+p-1) (interleaved, arXiv 2104.04473) of the step, and
    none deadlocks. The default suite's guard of the measured check (tests/integration/test_pp_vit.py)."""
    for p in (2, 3, 4):
        for v in (2, 3) if schedule == "interleaved_1f1b" else (1,):
            for m in (p, 2 * p, 3 * p):
                for backward in (1.0, 2.0):
                    step, busy = play(rank_orders(schedule, m, p, v), [1.0] * (p * v), [backward] * (p * v))
                    for b in busy:
                        assert (step - b) / step == pytest.approx(bubble_fraction(schedule, m, p, v)), (p, v, m)


def test_zero_bubble_played_out_idles_its_formula_and_less_than_1f1b():
    """ZB-H1 (arXiv 2401.10241): with F, B (input gradient) and W (weight gradient) equal, every
    rank idles (p-1)/(3m+p-1) for m >= p; with any costs, (p-1) max(B, F+B-W) of idle (stage 0
    waits for its first B; W passes fill the rest), never more than 1F1B's (p-1)(F+B+W) with the
    same total backward B+W. A W left in B's place (1F1B's order) idles more: the played-out
    orders are what tells them apart."""
    for p in (2, 3, 4):
        for m in (p, p + 1, 2 * p, 4 * p):
            orders = rank_orders("zero_bubble", m, p, 1)
            step, busy = play(orders, [1.0] * p, [1.0] * p, [1.0] * p)
            for b in busy:
                assert (step - b) / step == pytest.approx(bubble_fraction("zero_bubble", m, p)), (p, m)
            for f, bw, w in ((1.0, 1.3, 0.7), (1.0, 2.0, 2.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.3)):
                step, busy = play(orders, [f] * p, [bw] * p, [w] * p)
                idle = (p - 1) * max(bw, f + bw - w)
                assert all(step - b == pytest.approx(idle) for b in busy), (p, m, f, bw, w)
                step_1f1b, busy_1f1b = play(rank_orders("1f1b", m, p, 1), [f] * p, [bw + w] * p)
                assert all((step - b) / step < (step_1f1b - b1) / step_1f1b for b, b1 in zip(busy, busy_1f1b))
            # planted: each W right after its B (no deferral) idles 1F1B's bubble, not ZB-H1's
            undeferred = [[op for op in o if op[0] != "W"] for o in orders]
            undeferred = [
                [x for op in o for x in ((op, ("W", *op[1:])) if op[0] == "B" else (op,))] for o in undeferred
            ]
            step, busy = play(undeferred, [1.0] * p, [1.0] * p, [1.0] * p)
            assert (step - busy[0]) / step > bubble_fraction("zero_bubble", m, p) + 0.01


def test_a_deadlocking_order_is_caught():
    backwards_first = [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 0), ("F", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        play(backwards_first, [1.0, 1.0], [1.0, 1.0])


def test_peak_in_flight_is_the_schedules_stash():
    assert peak_in_flight(rank_orders("gpipe", 4, 2, 1)[0], [10]) == 40
    assert peak_in_flight(rank_orders("1f1b", 4, 2, 1)[0], [10]) == 20
    assert peak_in_flight(rank_orders("1f1b", 4, 2, 1)[1], [10]) == 10
    # interleaved, rank 0 of 2, v=2, m=4: warm-up F(c0: 0, 1), F(c1: 0, 1), then F(c0, 2), B(c1, 0),
    # F(c0, 3): all four of chunk 0 and micro-batch 1 of chunk 1 at once
    assert peak_in_flight(rank_orders("interleaved_1f1b", 4, 2, 2)[0], [10, 1]) == 4 * 10 + 1


def test_saved_tracker_counts_what_autograd_holds_and_frees_it():
    """A real forward's saved bytes (the count the planner is checked against), a micro-batch that
    is a slice of a batch counted as its slice, and nothing held once backward ran."""
    model, x = SmallCNN(), torch.randn(8, 3, 32, 32)
    tracker = SavedTracker(model.parameters())
    with tracker.hooks():
        loss = torch.nn.functional.cross_entropy(model(x[:4]), torch.zeros(4, dtype=torch.long))
    assert tracker.held == tracker.peak == saved_for_backward_bytes(model, 4)
    loss.backward()
    assert tracker.held == 0 and tracker.peak == saved_for_backward_bytes(model, 4)


def test_stage_plan_is_contiguous_and_honours_cuts():
    model = SmallCNN()
    names = [n for n, _ in model.named_children()]
    for stages in range(1, 6):
        plan = plan_stages(model, stages, [])
        assert [n for stage in plan for n in stage] == names and len(plan) == stages
        for stage in plan:  # every stage has weights to train
            assert sum(p.numel() for n in stage for p in model.get_submodule(n).parameters()) > 0
    assert plan_stages(model, 2, ["block3"]) == [["block1", "block2"], ["block3", "flatten", "fc1", "relu", "fc2"]]
    with pytest.raises(ConfigError, match="strategy.cuts names 'relu'"):
        plan_stages(model, 2, ["relu"])
    with pytest.raises(ConfigError, match="strategy.stages=6 is more than the 5 cuttable blocks"):
        plan_stages(model, 6, [])


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ["strategy.microbatches=16", "trainer.global_batch=32", "trainer.grad_accum=4"],
            ["strategy.microbatches=16", "8"],
        ),
        (["world_size=3", "strategy.stages=2"], ["strategy.stages=2", "world_size=3"]),
        (["strategy.impl=torch", "strategy.schedule=1f1b", "strategy.microbatches=1"], ["strategy.microbatches=1"]),
        (["strategy.cuts=[relu]"], ["relu"]),
        (["strategy.cuts=[fc1,block2]", "world_size=3", "strategy.stages=3"], ["strategy.cuts"]),
        (["strategy.schedule=interleaved"], ["strategy.schedule=interleaved"]),
        # more chunks than the cnn's 5 blocks
        (["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=3"], ["strategy.virtual_stages=3", "<=5"]),
        (["strategy.virtual_stages=2"], ["strategy.virtual_stages=2", "strategy.schedule=interleaved_1f1b"]),
        (["strategy.virtual_stages=0"], ["strategy.virtual_stages=0"]),
        (
            [
                "strategy.schedule=interleaved_1f1b",
                "strategy.virtual_stages=2",
                "strategy.microbatches=3",
                "trainer.global_batch=24",
            ],
            ["strategy.microbatches=3", "strategy.microbatches=2"],
        ),
        (
            ["model=vit", "strategy.schedule=zero_bubble", "strategy.virtual_stages=2"],
            ["strategy.virtual_stages=2", "ZB-H1", "strategy.impl=torch"],
        ),
        (["strategy.schedule=zero_bubble", "trainer.recompute=full"], ["trainer.recompute=full", "recompute=none"]),
        (["strategy.balance=size"], ["strategy.balance", "size"]),
        (["strategy.block_times=[1,2,3,4,5]"], ["strategy.block_times", "balance=time"]),
        (["strategy.balance=time", "strategy.block_times=[1,2]"], ["strategy.block_times=[1.0, 2.0]", "5 positive"]),
        (["model=vit", "model.dropout=0.1", "strategy.impl=torch"], ["model.dropout=0.1", "strategy.impl=manual"]),
        # torch's and DeepSpeed's pipelines backpropagate the last stage's loss alone: earlier MoE aux lost
        (["model=vit", "model.moe_experts=4", "strategy.impl=torch"], ["model.moe_experts=4", "strategy.impl=manual"]),
        (["model=vit", "model.moe_experts=4", "strategy.impl=deepspeed"], ["strategy.impl=deepspeed", "impl=manual"]),
        # dp x pp x tp (pp/tensor.py)
        (["strategy.tp=0"], ["strategy.tp=0", ">= 1"]),
        (["strategy.tp=2", "world_size=4"], ["strategy.tp=2", "model=cnn", "model=vit"]),
        (["model=vit", "strategy.tp=2", "world_size=4", "strategy.impl=torch"], ["strategy.impl=torch", "impl=manual"]),
        (["model=vit", "strategy.tp=2", "world_size=4", "strategy.impl=deepspeed"], ["strategy.impl=deepspeed"]),
        (
            ["model=vit", "strategy.tp=2", "world_size=2"],
            ["strategy.replicate=1 x strategy.stages=2 x strategy.tp=2 = 4", "world_size=2", "world_size=4"],
        ),
        (["model=vit", "strategy.tp=3", "world_size=6"], ["strategy.tp=3", "model.heads"]),
        (["model=vit", "strategy.sequence_parallel=true"], ["strategy.sequence_parallel=true", "strategy.tp=2"]),
    ],
)
def test_pp_bad_input_is_one_config_error(overrides, named):
    assert_one_line_config_error("pp", overrides, named)


def test_dp_x_pp_x_tp_layout_pipelines_are_tp_apart():
    """rank = (replica x stages + stage) x tp + tp rank: a stage's tp group is consecutive ranks, a
    pipeline takes the same tp coordinate of every stage (its sends), replicas are stages x tp apart."""
    from omegaconf import OmegaConf

    from parallel_lab.strategies.pp.rules import pp_dims

    dims = pp_dims(OmegaConf.create({"replicate": 2, "stages": 2, "tp": 2}))
    assert dims.sizes() == {"replicate": 2, "pp": 2, "tp": 2}
    assert dims.coords(5) == {"replicate": 1, "shard": 0, "cp": 0, "pp": 0, "tp": 1}
    assert dims.group_ranks(5, "tp") == [4, 5]
    assert dims.group_ranks(5, "pp") == [5, 7]
    assert dims.group_ranks(5, "replicate") == [1, 5]
    assert [dims.dp_rank(r) for r in range(8)] == [0] * 4 + [1] * 4  # a pipeline x tp block reads one share


def _simulated_gpipe(forward: list[float], backward: list[float], m: int) -> tuple[float, float]:
    """(step time, first stage's idle) of a GPipe step, event by event: a micro-batch enters a
    stage when it left the previous one and the stage finished the previous micro-batch; backward
    starts on the last stage once its forwards are done, and runs back."""
    p, done = len(forward), [0.0] * len(forward)
    for _ in range(m):
        for s in range(p):
            done[s] = max(done[s], done[s - 1] if s else 0.0) + forward[s]
    back = [done[-1]] * p
    for _ in range(m):
        for s in reversed(range(p)):
            back[s] = max(back[s], back[s + 1] if s + 1 < p else 0.0) + backward[s]
    return back[0], back[0] - m * (forward[0] + backward[0])


def test_gpipe_prediction_is_the_bubble_for_equal_stages_and_the_schedule_otherwise():
    """Equal stages: the first stage idles (p-1)/(m+p-1) of the step (arXiv 1811.06965). Unequal
    ones (what a real cut gives, backward not always the same multiple of forward): the same
    prediction as playing the schedule out."""
    for p in range(1, 5):
        for m in range(1, 7):
            fwd, bwd = [1.0 * m] * p, [2.0 * m] * p
            share = gpipe_first_stage_idle(fwd, bwd, m) / gpipe_step_time(fwd, bwd, m)
            assert share == pytest.approx((p - 1) / (m + p - 1))
    cases = (([1.0, 0.5], [2.0, 1.0]), ([0.4, 1.0], [1.5, 1.0]), ([1.0, 0.3, 0.7], [0.5, 0.9, 1.4]))
    for forward, backward in (*cases, ([0.2, 0.9, 0.9, 0.1], [0.4, 0.3, 2.0, 0.2])):
        for m in (1, 2, 4, 8):
            fwd, bwd = [m * f for f in forward], [m * b for b in backward]
            step, idle = _simulated_gpipe(forward, backward, m)
            assert gpipe_step_time(fwd, bwd, m) == pytest.approx(step), (forward, backward, m)
            assert gpipe_first_stage_idle(fwd, bwd, m) == pytest.approx(idle), (forward, backward, m)


def test_flops_balance_evens_out_the_cnns_compute_as_far_as_its_blocks_allow():
    """By parameters the cnn's cut leaves every convolution (97% of the FLOPs) on stage 0; by FLOPs
    the best cut of its five blocks: the largest stage share is the least any cut gives."""
    with torch.device("meta"):
        model = SmallCNN()
    by_params = plan_stages(model, 2, [], block_costs(model, "params"))
    by_flops = plan_stages(model, 2, [], block_costs(model, "flops"))
    share = [max(stage_shares([_stage(model, names) for names in plan])) for plan in (by_params, by_flops)]
    assert share[0] > 0.95 and share[1] < 0.7, share
    flops, blocks = layer_flops(model, 1), ["block1", "block2", "block3", "fc1", "fc2"]
    per_block = [sum(f for n, f in flops.items() if n.split(".")[0] == b) for b in blocks]
    best = min(max(sum(per_block[:k]), sum(per_block[k:])) for k in range(1, 5)) / sum(per_block)
    assert share[1] == pytest.approx(best)


def test_time_balance_is_measured_once_in_the_parent_and_cuts_by_it():
    """balance=time: validation (the parent) measures every block and writes the times into the
    config the ranks read; the cut is the balanced one of those times. Zero bubble: the same
    measurement's per-block F, B, W too (strategy.pass_times, its order's input: pp/zb_orders.py)."""
    from tests.support.model_parallel import compose_config

    cfg = compose_config(
        "strategy=pp", "model=vit", "strategy.balance=time", "strategy.schedule=zero_bubble", "trainer.global_batch=8"
    )
    times = list(cfg.strategy.block_times)
    assert len(times) == 6 and min(times) > 0
    passes = [list(t) for t in cfg.strategy.pass_times]
    assert len(passes) == 6 and all(f > 0 and b > 0 and w > 0 for f, b, w in passes[1:-1]), passes
    from parallel_lab.strategies.pp.rules import chunk_names, meta_model

    expected = plan_stages(meta_model(cfg), 2, [], times)
    assert chunk_names(cfg, meta_model(cfg)) == expected


def _stage(model, names):
    from collections import OrderedDict

    return torch.nn.Sequential(OrderedDict((n, model.get_submodule(n)) for n in names))


def test_tp_inside_stages_halves_the_split_layers_flops_in_the_step_time_shape():
    """The slowest stage's FLOP share under pp 2 x tp 2, derived here from the whole model's layer
    FLOPs: its blocks' Linears and attention cores halved, the embedding whole."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.models.flops import layer_flops
    from parallel_lab.strategies.pp.rules import PPPlan
    from tests.support.model_parallel import compose_config

    cfg = compose_config("strategy=pp", "model=vit", "strategy.tp=2", "world_size=4", "trainer.global_batch=16")
    model = build_meta_model(cfg.model)
    flops = layer_flops(model, 1)
    stage0 = [n for n in flops if n.split(".")[0] in ("embed", "block0", "block1")]
    split = sum(flops[n] for n in stage0 if n.startswith("block"))
    want = (sum(flops[n] for n in stage0) - split / 2) / sum(flops.values())
    assert PPPlan.compute_shape(cfg, model).flop_share == pytest.approx(want, rel=1e-12)
