"""pp x cp in the parent (parallel_lab/strategies/pp/cp_rules.py): what it does not build is refused
in one line naming the fix, the degrees must multiply to world_size, and the mesh puts a pipeline
on the ranks of one (replicate, cp) coordinate and a stage's cp group on its ranks of one
(replicate, pp). The runs: tests/integration/test_pp_tp.py (PP_CP)."""

from __future__ import annotations

import pytest

from tests.support.model_parallel import assert_one_line_config_error, compose_config
from tests.support.reference import GPT_RUN

PP_CP = ["model=vit", "strategy.cp=2", "world_size=4"]
REFUSALS = {  # overrides -> what the one line must name
    "impl-torch": (["strategy.impl=torch"], ["strategy.impl=torch", "strategy.impl=manual"]),
    "impl-deepspeed": (["strategy.impl=deepspeed"], ["strategy.impl=deepspeed", "strategy.impl=manual"]),
    "interleaved": (
        ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"],
        ["strategy.schedule=interleaved_1f1b", "strategy.schedule=gpipe|1f1b"],
    ),
    "zero-bubble": (["strategy.schedule=zero_bubble"], ["strategy.schedule=zero_bubble", "gpipe|1f1b"]),
    "tp": (["strategy.tp=2", "world_size=8"], ["strategy.tp=2", "strategy.tp=1"]),
    "cp-impl-deepspeed": (["strategy.cp_impl=deepspeed"], ["strategy.cp_impl=deepspeed", "ring|ulysses"]),
    "degrees": (["world_size=6"], ["strategy.cp=2 x strategy.stages=2 = 4", "world_size=6", "world_size=4"]),
    "cp-0": (["strategy.cp=0"], ["strategy.cp=0", "strategy.cp=2"]),
    "model": (["model=cnn"], ["model=cnn", "model=vit"]),
    "dropout": (["model.dropout=0.1"], ["model.dropout=0.1", "model.dropout=0"]),
    "bf16": (["strategy.precision=bf16"], ["strategy.precision=bf16", "fp32"]),
    "gpt-seq": ([*GPT_RUN, "model.seq=6"], ["model.seq=6", "multiple of 4"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_pp_cp_refusals_are_one_line_in_the_parent(case):
    overrides, named = REFUSALS[case]
    assert_one_line_config_error("pp", [*PP_CP, *overrides], named)


def test_pp_cp_mesh_puts_pipelines_on_cp_coordinates():
    """world 8 = replicate 2 x cp 2 x 2 stages: pipeline (r, c) is ranks 4r + 2c, 4r + 2c + 1; a
    stage's cp group pairs the ranks 2 apart; both cp pipelines of a replica read its samples."""
    from parallel_lab.strategies.pp.chunks import pp_dims, stage_of
    from parallel_lab.strategies.pp.rules import PPPlan

    cfg = compose_config("strategy=pp", "model=vit", "strategy.cp=2", "strategy.replicate=2", "world_size=8")
    dims = pp_dims(cfg.strategy)
    assert [dims.group_ranks(r, "pp") for r in (0, 2, 5)] == [[0, 1], [2, 3], [4, 5]]
    assert [dims.group_ranks(r, "cp") for r in (0, 1, 5)] == [[0, 2], [1, 3], [5, 7]]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [stage_of(cfg, r) for r in range(8)] == [0, 1] * 4
    assert PPPlan.data_parallel_size(cfg) == 2


@pytest.mark.parametrize("model", ["vit", "gpt"])
def test_pp_cp_stage_computes_about_half_the_tokens(model):
    """The step-time model's compute: a cp rank of the slowest stage does 1/cp of its FLOPs on the
    gpt, a little more on the vit (its patch convolution and classifier whole on every cp rank:
    +3.6% of half at the default sizes)."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.strategies.pp.rules import PPPlan

    run = [*GPT_RUN] if model == "gpt" else ["model=vit"]
    plain = compose_config("strategy=pp", *run, "world_size=2")
    cp = compose_config("strategy=pp", *run, "strategy.cp=2", "world_size=4")
    meta = build_meta_model(plain.model)
    full, half = (PPPlan.compute_shape(c, meta).flop_share for c in (plain, cp))
    if model == "gpt":
        assert half == pytest.approx(full / 2, rel=1e-9), (full, half)
    else:
        assert full / 2 < half < 1.05 * full / 2, (full, half)
