"""The step-time model's arithmetic (parallel_lab.plan.steptime), in-process and untimed: what it
predicts for given calibration numbers, never how fast this machine is (that is
``python -m parallel_lab.bench plantime``'s table, docs/plan.md)."""

from __future__ import annotations

import functools

import pytest

from parallel_lab.models import build_meta_model
from parallel_lab.models.flops import layer_flops
from parallel_lab.plan.configs import planned_configs
from parallel_lab.plan.steptime import (
    BACKWARD_SHARE,
    AlphaBeta,
    Compute,
    fit_alpha_beta,
    fit_compute,
    predict_step,
)
from parallel_lab.strategies import get_strategy_class
from parallel_lab.strategies.pp.plan import stage_shares
from parallel_lab.strategies.tp.predict import tp_share

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _fits(alpha: float, beta: float) -> dict[str, dict[str, AlphaBeta]]:
    return {impl: {op: AlphaBeta(alpha, beta) for op in OPS} for impl in ("gloo", "hand")}


@functools.cache
def _model():
    return build_meta_model(_cfg("ddp").model)


@functools.cache  # composing a config costs ~0.3 s: each one once
def _cfg(strategy: str, *extra: str):
    """The validated config, as the planner makes it (ZeRO's stage comes from the strategy's name)."""
    (planned,) = planned_configs(
        [f"strategy={strategy}", "model=cnn", "world_size=2", "trainer.global_batch=64", *extra]
    )
    return planned.cfg


def _predict(strategy: str, compute: Compute, fits, *extra: str):
    cfg = _cfg(strategy, *extra)
    model = _model()
    return predict_step(cfg, get_strategy_class(strategy), model, compute, fits), model


def test_alpha_beta_fit_recovers_the_line_it_was_given():
    alpha, beta = 80e-6, 1.5e9
    sizes = [4096 * 4**k for k in range(7)]
    fit = fit_alpha_beta([(s, alpha + s / beta) for s in sizes])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.beta_Bps == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta([(4096, 1e-4)])


def test_compute_fit_is_the_line_through_two_runs():
    c = fit_compute((32, 0.020), (64, 0.036), optimizer_s=0.004, params=1_000_000)
    assert c.per_sample_s == pytest.approx(0.016 / 32)
    assert c.fwd_bwd(32) == pytest.approx(0.020) and c.fwd_bwd(64) == pytest.approx(0.036)
    assert c.optimizer(500_000) == pytest.approx(0.002)
    # A loaded machine can make the larger batch no slower: a flat line, never a negative slope.
    flat = fit_compute((32, 0.030), (64, 0.028), optimizer_s=0.004, params=1_000_000)
    assert flat.per_sample_s == 0.0 and flat.fwd_bwd(16) == pytest.approx(0.029)


def test_ddp_step_is_compute_plus_alpha_plus_bytes_over_beta():
    compute = Compute(fixed_s=0.003, per_sample_s=0.0005, per_param_s=2e-9)
    alpha, beta = 100e-6, 1e9
    pred, model = _predict("ddp", compute, _fits(alpha, beta))
    params = sum(p.numel() for p in model.parameters())
    fwd_bwd = 0.003 + 0.0005 * 32  # each of 2 ranks: 32 of the 64 samples
    comm = alpha + 4 * params / beta  # one all-reduce of every fp32 gradient
    assert pred.upper_s == pytest.approx(fwd_bwd + 2e-9 * params + comm)
    # DDP all-reduces during backward: the lower bound hides it behind backward's share.
    assert pred.lower_s == pytest.approx(fwd_bwd + 2e-9 * params + max(0.0, comm - BACKWARD_SHARE * fwd_bwd))
    assert pred.lower_s < pred.upper_s


def test_more_bytes_on_the_wire_predict_a_longer_step():
    """Equal compute (optimizer cost 0): the order of predicted steps is the order of the bytes
    ``predict_comm`` counts (ddp 2 psi < zero1 3 psi), and a slower link makes every step longer."""
    compute = Compute(fixed_s=0.003, per_sample_s=0.0005, per_param_s=0.0)
    fits = _fits(50e-6, 1e9)
    ddp, _ = _predict("ddp", compute, fits)
    zero1, _ = _predict("zero1", compute, fits)
    assert ddp.compute_s == pytest.approx(zero1.compute_s)
    assert zero1.upper_s > ddp.upper_s
    slow, _ = _predict("ddp", compute, _fits(50e-6, 0.5e9))
    assert slow.upper_s > ddp.upper_s
    unbucketed, _ = _predict("manual_ddp", compute, fits, "strategy.bucketed=false")
    assert unbucketed.lower_s == pytest.approx(unbucketed.upper_s)  # all-reduce after backward: nothing hidden


def test_sharded_optimizer_and_split_layers_do_less_work():
    compute = Compute(fixed_s=0.0, per_sample_s=0.001, per_param_s=1e-8)
    fits = _fits(0.0, 1e12)
    ddp, model = _predict("ddp", compute, fits)
    zero1, _ = _predict("zero1", compute, fits)
    assert zero1.optimizer_s == pytest.approx(ddp.optimizer_s / 2, rel=1e-3)
    # tp: whole batch, the split fc1/fc2 halved; fc1 alone is 82% of the parameters but few FLOPs.
    flops = layer_flops(model, 1)
    fc1 = model.get_submodule("fc1")
    assert flops["fc1"] == 2 * fc1.in_features * fc1.out_features
    share = tp_share(model, ["fc1", "fc2"], 2)
    assert share == pytest.approx(1 - (flops["fc1"] + flops["fc2"]) / 2 / sum(flops.values()))
    tp, _ = _predict("tp", compute, fits)
    assert tp.fwd_bwd_s == pytest.approx(share * 0.001 * 64)


def test_pipeline_pays_its_bubble():
    compute = Compute(fixed_s=0.0, per_sample_s=0.001, per_param_s=0.0)
    pred, model = _predict("pp", compute, _fits(0.0, 1e12))
    from parallel_lab.strategies.pp.rules import _stage_module

    cfg = _cfg("pp")
    shares = stage_shares([_stage_module(cfg, model, s) for s in range(2)])
    assert sum(shares) == pytest.approx(1.0)
    # 4 micro-batches of 16, 4 + 2 - 1 slots paced by the slower stage: never less than one rank alone.
    assert pred.fwd_bwd_s == pytest.approx(5 * max(shares) * 0.001 * 16)
    assert pred.fwd_bwd_s > 0.001 * 64 / 2
