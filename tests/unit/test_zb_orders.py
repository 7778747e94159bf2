"""Zero bubble's order built from measured per-stage F, B, W (pp/zb_orders.py, Qi et al. arXiv
2401.10241 section 3.1), played out in pure Python: every stage idles at most what 1F1B's order
idles at the same costs (its backward one pass of B + W), every dependency holds, at most p
micro-batches wait for their W on any stage (ZB-H1's memory limit, 1F1B's first stage's peak),
and with equal passes it is ZB-H1's bubble. The orders on real ranks: tests/integration/test_bubbles.py
(extra) and tests/integration/test_pp_vit.py (the activation plan of a built order, to the byte)."""

from __future__ import annotations

import random

import pytest

from parallel_lab.strategies.pp import zb_orders
from parallel_lab.strategies.pp.schedules import bubble_fraction, play, rank_orders
from tests.support.model_parallel import assert_one_line_config_error, compose_config


def random_passes(rnd: random.Random, p: int) -> list[tuple[float, float, float]]:
    """Per stage an (F, B, W) with W <= B: the stages differ, as a cut's ends do (embedding, loss)."""
    out = []
    for _ in range(p):
        b = rnd.uniform(0.3, 2.0)
        out.append((rnd.uniform(0.3, 2.0), b, rnd.uniform(0.05, 1.0) * b))
    return out


def idle(orders, passes, handoff: float = 0.0, split: bool = True) -> list[float]:
    f, b, w = ([x[k] for x in passes] for k in range(3))
    step, busy = (
        play(orders, f, b, w, handoff) if split else play(orders, f, [x + y for x, y in zip(b, w)], None, handoff)
    )
    return [(step - t) / step for t in busy]


def check_order(order, m: int, p: int) -> int:
    """Every micro-batch's F, B and W once, in micro-batch order per pass, B after its F and W after
    its B on the rank (the play checks the cross-rank inputs); returns the most micro-batches
    between a forward and its W at once."""
    for kind in "FBW":
        assert [i for op, _, i in order if op == kind] == list(range(m)), order
    seen, held, peak = set(), 0, 0
    for op, _, i in order:
        assert op == "F" or (("F" if op == "B" else "B"), i) in seen, (op, i, order)
        seen.add((op, i))
        held += {"F": 1, "B": 0, "W": -1}[op]
        peak = max(peak, held)
    return peak


def test_built_order_idles_at_most_1f1b_on_every_stage_within_zb_h1s_memory():
    """200 random per-stage (F, B, W) with W <= B at p = 2..4, m = p..3p, with and without a
    hand-off latency: the built order's per-stage idle <= 1F1B's and <= ZB-H1's, every dependency
    met (the play would raise on a deadlock), at most p micro-batches held until their W; and the
    order matters: 1F1B's is beaten on every stage in nearly every case, ZB-H1's fixed order in
    many (where the stages' passes differ). Planted (in built_orders): W passes deferred to the
    end held m > p micro-batches; 1F1B's order with W after B never beat 1F1B; the greedy alone
    without W filling its idle (gap 1e9) beat ZB-H1 in no case."""
    rnd = random.Random(47)
    better_1f1b = better_zb = cases = 0
    for _ in range(200):
        p = rnd.choice((2, 3, 4))
        m = rnd.randint(p, 3 * p)
        passes, handoff = random_passes(rnd, p), rnd.choice((0.0, 0.05))
        orders = zb_orders.built_orders(m, p, passes, handoff)
        for order in orders:
            assert check_order(order, m, p) <= p, (p, m, passes, order)
        built = idle(orders, passes, handoff)
        one_f = idle(rank_orders("1f1b", m, p, 1), passes, handoff, split=False)
        zb_h1 = idle(rank_orders("zero_bubble", m, p, 1), passes, handoff)
        assert all(b <= o + 1e-9 and b <= z + 1e-9 for b, o, z in zip(built, one_f, zb_h1)), (p, m, passes)
        cases += 1
        better_1f1b += all(b < o - 1e-9 for b, o in zip(built, one_f))
        better_zb += all(b < z - 1e-9 for b, z in zip(built, zb_h1))
    assert better_1f1b >= 0.95 * cases, (better_1f1b, cases)
    assert better_zb >= 0.15 * cases, (better_zb, cases)


def test_built_order_at_equal_passes_is_zb_h1s_bubble():
    """F = B = W on every stage: the built order idles (p-1)/(3m+p-1), ZB-H1's (arXiv 2401.10241)."""
    for p in (2, 3, 4):
        for m in range(p, 3 * p + 1):
            orders = zb_orders.built_orders(m, p, [(1.0, 1.0, 1.0)] * p)
            assert idle(orders, [(1.0, 1.0, 1.0)] * p) == pytest.approx([bubble_fraction("zero_bubble", m, p)] * p)


def test_the_greedy_alone_fills_the_first_stages_idle_with_w():
    """A cut whose first stage forwards slowly and backpropagates fast (the embedding has no input
    gradient) and whose last stage is the opposite: the greedy's order beats ZB-H1's fixed one
    on every stage, and 1F1B's."""
    p, m, passes = 2, 8, [(1.2, 0.5, 0.3), (0.6, 0.8, 0.5)]
    greedy = zb_orders.greedy_orders(m, p, passes, p)
    for order in greedy:
        assert check_order(order, m, p) <= p
    built = idle(greedy, passes)
    assert all(g < z for g, z in zip(built, idle(rank_orders("zero_bubble", m, p, 1), passes))), built
    assert all(g < o for g, o in zip(built, idle(rank_orders("1f1b", m, p, 1), passes, split=False))), built


def test_stage_passes_sum_each_stages_blocks_of_the_time_cut_and_no_passes_run_zb_h1():
    cfg = compose_config(
        "strategy=pp",
        "model=vit",
        "strategy.schedule=zero_bubble",
        "strategy.balance=time",
        "strategy.block_times=[1,1,1,1,10,1]",
        "strategy.pass_times=[[1.0,0.5,0.0],[0.5,1.0,0.0],[0.5,0.5,1.0],[1.0,1.0,1.0],[5.0,3.0,2.0],[1.0,0.5,0.0]]",
        "trainer.global_batch=8",
    )
    passes = [(3.0, 3.0, 2.0), (6.0, 3.5, 2.0)]
    assert zb_orders.stage_passes(cfg.strategy) == passes  # the time cut: before block 4 (the 10)
    o = cfg.strategy
    assert zb_orders.run_orders(o) == zb_orders.built_orders(o.microbatches, o.stages, passes)
    o.pass_times = []
    assert zb_orders.stage_passes(o) is None
    assert zb_orders.run_orders(o) == rank_orders("zero_bubble", o.microbatches, o.stages, 1)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["strategy.schedule=1f1b", "strategy.balance=time", "strategy.pass_times=[[1.0,1.0,1.0]]"],
            ["strategy.pass_times", "schedule=1f1b", "drop strategy.pass_times"],
        ),
        (
            ["strategy.schedule=zero_bubble", "strategy.balance=time", "strategy.block_times=[1,1,1,1,1]"]
            + ["strategy.pass_times=[[1.0,1.0,1.0],[1.0,1.0]]"],
            ["strategy.pass_times=[[1.0, 1.0, 1.0], [1.0, 1.0]]", "5 [F, B, W]"],
        ),
    ],
)
def test_bad_pass_times_are_one_config_error(overrides, named):
    assert_one_line_config_error("pp", overrides, named)


def test_block_times_given_by_hand_measure_nothing_and_run_zb_h1():
    """Zero bubble with block times given and no pass times: nothing measured, ZB-H1's order (the
    parent's measurement of both: tests/unit/test_pipeline_parallel.py test_time_balance_...)."""
    given = ["strategy.balance=time", "strategy.block_times=[1.0,1.0,1.0,1.0,1.0]", "trainer.global_batch=8"]
    cfg = compose_config("strategy=pp", "strategy.schedule=zero_bubble", *given)
    assert list(cfg.strategy.pass_times) == [] and zb_orders.stage_passes(cfg.strategy) is None
