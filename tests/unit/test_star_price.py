"""manual_ddp's star all-reduce priced apart from its ring (plan/steptime.py ``star_factors``,
``algorithm_op``; the calibration's ``all_reduce_star``): derived here by hand from the fits a
calibration gives, at world 2 and 3, and an older calibration's star from gloo's send."""

from __future__ import annotations

import dataclasses

import pytest

from parallel_lab.plan.calibrate import Calibration
from parallel_lab.plan.comm_calibration import STAR_OP
from parallel_lab.plan.configs import planned_configs
from parallel_lab.plan.steptime import predict_comm_seconds, predict_step
from parallel_lab.strategies import get_strategy_class
from tests.unit.test_plantime import _calib, _model

# chosen here, none measured: the ring over shared memory fast per message, the star over gloo slow
RING = {"alpha_s": 50e-6, "beta_Bps": 4e9}
STAR = {"alpha_s": 300e-6, "beta_Bps": 1e9}
GLOO_SEND = {"alpha_s": 150e-6, "beta_Bps": 2e9}


def _star_calib(**kw) -> Calibration:
    calib = _calib(**kw)
    gloo = {op: dict(fit) for op, fit in calib.collectives["gloo"].items()}
    gloo["broadcast"] = dict(GLOO_SEND)
    hand = {op: dict(RING) for op in ("all_reduce", "all_gather", "reduce_scatter")}
    return dataclasses.replace(calib, collectives={"gloo": gloo, "hand": {**hand, STAR_OP: dict(STAR)}})


def _cfg(world: int, algorithm: str):
    overrides = ["strategy=manual_ddp", "model=cnn", f"world_size={world}", "trainer.global_batch=48"]
    (planned,) = planned_configs([*overrides, "strategy.bucketed=false", f"strategy.allreduce={algorithm}"])
    return planned.cfg


def _all_reduce_s(world: int, algorithm: str, calib: Calibration) -> float:
    cfg, cls = _cfg(world, algorithm), get_strategy_class("manual_ddp")
    shape = cls.plan.compute_shape(cfg, _model())
    return predict_comm_seconds(cfg, cls, _model(), calib, shape)[0]["all_reduce"]


@pytest.mark.parametrize("world", [2, 3])
def test_the_star_is_priced_from_its_own_line_through_rank_0(world):
    """One all-reduce of the cnn's G bytes of fp32 gradients a step (unbucketed). The star, by
    hand: rank 0 receives w-1 tensors and sends the sum w-1 times, 2(w-1) messages and 2(w-1)G
    bytes, against 2 and 2G at world 2 where it was timed: (w-1) x (alpha + G / beta) of the star's
    own fit. The ring: 2(w-1) steps of G/w bytes, (w-1) x alpha + 2(w-1)/w x G / beta of its fit."""
    calib = _star_calib()
    grad_bytes = 4 * sum(p.numel() for p in _model().parameters())
    star = (world - 1) * (STAR["alpha_s"] + grad_bytes / STAR["beta_Bps"])
    ring = (world - 1) * RING["alpha_s"] + 2 * (world - 1) / world * grad_bytes / RING["beta_Bps"]
    assert _all_reduce_s(world, "star", calib) == pytest.approx(star)
    assert _all_reduce_s(world, "ring", calib) == pytest.approx(ring)
    assert star > 1.5 * ring  # the two differ here, and the step says which is faster
    slow = predict_step(_cfg(world, "star"), get_strategy_class("manual_ddp"), _model(), calib).point_s
    fast = predict_step(_cfg(world, "ring"), get_strategy_class("manual_ddp"), _model(), calib).point_s
    assert slow - fast == pytest.approx(star - ring)


def test_a_faster_star_wins_and_a_calibration_without_it_prices_the_all_reduce():
    """The price follows the fit, not the name: a star timed faster than the ring is predicted
    faster; a calibration that has no star line (a GPU's: nccl only) prices it as its all-reduce."""
    calib = _star_calib()
    calib.collectives["hand"][STAR_OP] = {"alpha_s": 10e-6, "beta_Bps": 16e9}
    assert _all_reduce_s(2, "star", calib) < _all_reduce_s(2, "ring", calib)
    del calib.collectives["hand"][STAR_OP]
    assert _all_reduce_s(2, "star", calib) == pytest.approx(_all_reduce_s(2, "ring", calib))


def test_an_older_calibration_replays_the_star_as_two_of_gloos_sends():
    """Before version 6 the star was not timed: upgraded, it is gloo's one send at world 2 (its
    broadcast) twice in a row, rank 1's tensor in and the sum back: alpha x 2, beta / 2."""
    data = dataclasses.asdict(_star_calib())
    del data["collectives"]["hand"][STAR_OP]
    data["version"] = 5
    calib = Calibration.upgraded(data)
    want = {"alpha_s": 2 * GLOO_SEND["alpha_s"], "beta_Bps": GLOO_SEND["beta_Bps"] / 2}
    assert calib.collectives["hand"][STAR_OP] == pytest.approx(want)
    assert calib.collectives["hand"]["all_reduce"] == RING  # the ring's own line untouched
