"""MoE rows in the report, in-process (+experiment=compare_vit's ep rows, conf/strategy/ep/): a row
of the MoE vit is judged against the MoE `single`, never the dense one of the same model name, and
its label says so where both stand in one table. The runs themselves: tests/integration/test_ep.py."""

from __future__ import annotations

from types import SimpleNamespace

from parallel_lab.report.columns import mark_variants, strategy_label
from parallel_lab.report.table import Row, baseline_key

DENSE, MOE = 64_778 + 2 * 16_576, 64_778 + 4 * 16_576  # the tests' vit: two experts' worth of MLP more


def row(strategy: str, params: int, experts: int, **options) -> Row:
    same = dict(model="vit", global_batch=16, steps=3, data="synthetic", optimizer="adam", lr=1e-3, norm="group")
    metrics = SimpleNamespace(
        strategy=strategy, params=params, moe_experts=experts, strategy_options={"name": strategy, **options},
        noise_rerun=None, ulp_jitter_seed=None, **same,
    )  # fmt: skip
    return Row(strategy, metrics)


def test_an_moe_row_is_grouped_with_the_moe_baseline_and_labelled():
    single, single_moe = row("single", DENSE, 0), row("single", MOE, 4)
    ddp, ddp_ep = row("ddp", DENSE, 0, ep=1), row("ddp", MOE, 4, ep=2)
    zero2_ep = row("zero2", MOE, 4, ep=2)
    assert baseline_key(ddp_ep) == baseline_key(zero2_ep) == baseline_key(single_moe) != baseline_key(single)
    assert baseline_key(ddp) == baseline_key(single)
    mark_variants([single, single_moe, ddp, ddp_ep, zero2_ep])
    assert [strategy_label(r) for r in (single, single_moe, ddp, ddp_ep, zero2_ep)] == [
        "single", "single moe_experts=4", "ddp ep=1", "ddp moe_experts=4 ep=2", "zero2",
    ]  # fmt: skip
