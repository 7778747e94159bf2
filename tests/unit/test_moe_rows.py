"""MoE rows in the report, in-process (+experiment=compare_vit's and compare_gpt's ep rows,
conf/strategy/ep/): a row of the MoE vit is judged against the MoE `single`, never the dense one of
the same model name, and its label says so where both stand in one table; each comparison's sweep
names the cp and ep rows, and each of them composes and passes the parent's checks on its model.
The runs themselves: tests/integration/test_ep.py, test_cp_vit.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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
        "single", "single moe_experts=4", "ddp", "ddp moe_experts=4 ep=2", "zero2 ep=2",
    ]  # fmt: skip


def test_a_label_shows_only_the_options_that_differ_from_their_defaults():
    """compare_gpt's ddp rows: the dense one at every default, the ring at cp=2 (ring: the default
    cp_impl), Ulysses, and the MoE one with ep=2 (its cp at the default 1)."""
    dense = row("ddp", DENSE, 0, cp=1, cp_impl="ring", ep=1)
    ring, ulysses = (
        row("ddp", DENSE, 0, cp=2, cp_impl="ring", ep=1),
        row("ddp", DENSE, 0, cp=2, cp_impl="ulysses", ep=1),
    )
    ep = row("ddp", MOE, 4, cp=1, cp_impl="ring", ep=2)
    mark_variants([dense, ring, ulysses, ep])
    assert [strategy_label(r) for r in (dense, ring, ulysses, ep)] == [
        "ddp", "ddp cp=2", "ddp cp=2 cp_impl=ulysses", "ddp moe_experts=4 ep=2",
    ]  # fmt: skip


def test_a_lone_row_off_its_defaults_says_so():
    """One pp row in a sweep, on DeepSpeed's pipeline: labelled by the impl it ran, not bare ``pp``
    (nothing varies among pp's rows, but impl is off its default)."""
    lone = row("pp", DENSE, 0, impl="deepspeed", stages=2, schedule="gpipe")
    mark_variants([lone, row("ddp", DENSE, 0, cp=1, ep=1)])
    assert strategy_label(lone) == "pp impl=deepspeed"


# The rows compare_vit and compare_gpt run beside every registered strategy: (cp, cp_impl, ep, experts)
MODEL_ROWS = {
    "cp/ddp_ring": ("ddp", 2, "ring", 1, 0),
    "cp/ddp_ulysses": ("ddp", 2, "ulysses", 1, 0),
    "ep/single": ("single", 1, None, 1, 4),
    "ep/ddp": ("ddp", 1, None, 2, 4),
    "ep/fsdp": ("fsdp", 1, None, 2, 4),
    "ep/zero2": ("zero2", 1, None, 2, 4),
}


COMPARISONS = [("compare_vit", "vit", "synthetic"), ("compare_gpt", "gpt", "tokens")]


@pytest.mark.parametrize("experiment, model, data", COMPARISONS)
def test_each_comparison_sweeps_the_cp_and_ep_rows_and_each_passes_the_parents_checks(experiment, model, data):
    """Compose-only (no process starts): the sweep's strategy list holds every cp/ep row, and each
    row composes on the experiment's model and data and is not refused (config.validate, the
    parent's checks before any process starts), with the degrees its yaml promises."""
    from hydra import compose, initialize_config_dir

    from parallel_lab import config
    from parallel_lab.config.compose import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # as the sweep composes a job
        swept = compose(config_name="config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
        composed = [compose(config_name="config", overrides=[f"+experiment={experiment}", f"strategy={row}"])
                    for row in MODEL_ROWS]  # fmt: skip
    assert set(MODEL_ROWS) <= set(str(swept.hydra.sweeper.params.strategy).split(",")), experiment
    for (row, (name, cp, impl, ep, experts)), cfg in zip(MODEL_ROWS.items(), composed):
        cfg = config.validate(cfg, warn=lambda message: None)
        s = cfg.strategy
        assert (cfg.model.name, cfg.data.name, s.name) == (model, data, name), (experiment, row)
        assert (s.get("cp", 1), s.get("cp_impl") if cp > 1 else None, s.get("ep", 1)) == (cp, impl, ep), (row, s)
        assert (cfg.model.get("moe_experts") or 0, cfg.world_size) == (experts, 1 if name == "single" else 2), row
