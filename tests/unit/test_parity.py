"""The parity criterion (parallel_lab/report/parity.py) itself, in-process: what it accepts and what
it refuses, its noise-floor reruns and jitters. That it marks deliberately broken data parallelism
FAIL while the real strategy passes, on real ranks: tests/integration/test_parity.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

from parallel_lab.report.parity import (
    EARLY_STEPS,
    ENVELOPE_MULTIPLE,
    FLOOR_ULPS,
    Gaps,
    adam_element_bound,
    judge,
    noise_reruns,
    ulp,
)
from parallel_lab.worker.noise import jitter_gradients, jitter_one_ulp

pytestmark = pytest.mark.parity  # every test here judges parity (make test runs them twice)

BASE_LOSSES = [2.3] * 10
BASE_PARAMS = {"w": torch.ones(4)}
LOSS_FLOOR = FLOOR_ULPS * ulp(2.3)


def _gaps(loss, rel_l2=0.0, max_abs=0.0) -> Gaps:
    return Gaps(list(loss), rel_l2, max_abs)


def test_jitter_moves_every_weight_by_exactly_one_ulp():
    net = torch.nn.Linear(30, 20)
    before = [p.detach().clone() for p in net.parameters()]
    jitter_one_ulp(net, seed=1)
    for old, new in zip(before, net.parameters()):
        assert (new != old).all()
        up = torch.nextafter(old, torch.full_like(old, math.inf))
        down = torch.nextafter(old, torch.full_like(old, -math.inf))
        assert ((new == up) | (new == down)).all()
        assert (new == up).any() and (new == down).any()


def test_a_row_inside_the_envelope_passes_and_the_ratio_is_reported():
    env = _gaps([0, 0, 0, 0, 0, 1e-6, 1e-5, 1e-4, 2e-4, 3e-4], 1e-3, 1e-3)
    row = _gaps([0, 2.4e-7, 0, 0, 0, 1e-5, 1e-4, 5e-4, 1e-3, 2e-3], 5e-3, 4e-3)
    verdict = judge(row, env, BASE_LOSSES, BASE_PARAMS)
    assert verdict.passed, verdict.reason()
    assert verdict.max_dloss.ratio == pytest.approx(2e-3 / (3e-4 + LOSS_FLOOR / ENVELOPE_MULTIPLE))


def test_an_early_gap_fails_even_when_chaos_later_widens_the_envelope():
    env = _gaps([0] * EARLY_STEPS + [1e-3] * 5, 1e-2, 1e-2)
    row = _gaps([0, 1e-4] + [0] * 8)  # a wrong step 1: far below the late envelope, far above the early one
    verdict = judge(row, env, BASE_LOSSES, BASE_PARAMS)
    assert not verdict.passed and "early_dloss" in verdict.reason()


@pytest.mark.parametrize("field", ["loss", "rel_l2", "max_abs"])
def test_each_whole_run_measure_can_fail_on_its_own(field):
    env = _gaps([1e-5] * 10, 1e-3, 1e-3)
    inside = {"loss": [1e-5] * 10, "rel_l2": 1e-3, "max_abs": 1e-3}
    outside = {"loss": [1e-5] * EARLY_STEPS + [1e-3] * 5, "rel_l2": 1e-1, "max_abs": 1e-1}
    verdict = judge(_gaps(**{**inside, field: outside[field]}), env, BASE_LOSSES, BASE_PARAMS)
    assert not verdict.passed
    assert judge(_gaps(**inside), env, BASE_LOSSES, BASE_PARAMS).passed


def test_a_zero_envelope_still_allows_the_float_floor_and_no_more():
    env = _gaps([0] * 10)
    assert judge(_gaps([LOSS_FLOOR] * 10), env, BASE_LOSSES, BASE_PARAMS).passed
    assert not judge(_gaps([2 * LOSS_FLOOR] * 10), env, BASE_LOSSES, BASE_PARAMS).passed


def test_under_adam_one_weight_may_move_by_adams_bound_and_no_more():
    """Adam's high gain: a gradient within rounding of zero can turn one weight's update from
    +lr to -lr, so the parameter floors allow one weight moved by 2 lr a step, not two."""
    env, lr = _gaps([0] * 10), 1e-3
    one_weight = adam_element_bound(lr, len(BASE_LOSSES))
    theta_norm = float(BASE_PARAMS["w"].norm())
    one = _gaps([0] * 10, 0.9 * one_weight / theta_norm, 0.9 * one_weight)
    assert judge(one, env, BASE_LOSSES, BASE_PARAMS, adam_lr=lr).passed
    assert not judge(one, env, BASE_LOSSES, BASE_PARAMS).passed  # under SGD (no Adam floor) it fails
    two = _gaps([0] * 10, math.sqrt(2) * one_weight / theta_norm, one_weight)  # two weights moved by the bound
    verdict = judge(two, env, BASE_LOSSES, BASE_PARAMS, adam_lr=lr)
    assert not verdict.passed and "param_rel_l2" in verdict.reason()


def test_gradient_jitter_moves_each_gradient_by_one_ulp_of_its_largest():
    """Near zero (where Adam's gain is), every element moves by eps x the tensor's largest |gradient|."""
    w = torch.nn.Parameter(torch.zeros(400))
    w.grad = torch.empty(400).uniform_(-1e-3, 1e-3)
    w.grad[0] = 2.0
    before = w.grad.clone()
    jitter_gradients([w], torch.Generator().manual_seed(1))
    moved = (w.grad - before)[1:]
    eps = float(torch.finfo(torch.float32).eps)
    assert torch.allclose(moved.abs(), torch.full_like(moved, 2.0 * eps), rtol=0.01)
    assert (moved > 0).any() and (moved < 0).any()


def test_noise_reruns_change_only_last_bits_and_fit_the_batch():
    reruns = noise_reruns(global_batch=24, grad_accum=1, threads=2)
    assert reruns == {
        "ulp_jitter_seed=1": {"ulp_jitter_seed": 1},
        "ulp_jitter_seed=2": {"ulp_jitter_seed": 2},
        "ulp_jitter_seed=3": {"ulp_jitter_seed": 3},
        "grad_ulp_seed=1": {"grad_ulp_seed": 1},
        "micro_batches=2": {"grad_accum": 2},
        "micro_batches=4": {"grad_accum": 4},
        "threads=1": {"threads": 1},
    }
    odd = noise_reruns(global_batch=6, grad_accum=3, threads=1)  # 6 = 3 x 2: no further split fits
    assert "micro_batches=6" in odd and "micro_batches=12" not in odd and odd["threads=2"] == {"threads": 2}


def test_a_reference_leaves_the_thread_count_it_found():
    """The test bodies compute the reference inside rank 0 only: its threads=2 noise rerun left
    behind would make rank 0 train the next configuration with other kernel splits than its peers
    (tp ranks then disagreed on a replicated layer's last bits)."""
    from tests.support.reference import reference_run

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference_run("cnn", steps=0, global_batch=8, data_size=16, threads=2)  # sets 2, trains nothing
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


def test_a_reference_read_from_the_session_store_is_the_one_computed(tmp_path, monkeypatch):
    """A reference another process of the session computed (tests/support/reference.py's store) is
    read back bit for bit: its losses, its final parameters, its noise floor and a forward of its
    model; a store whose model state is not loaded back would hand every reader initial weights."""
    from tests.support import reference

    monkeypatch.setenv(reference.SHARED_REFERENCES_ENV, str(tmp_path))
    args = {"steps": 2, "global_batch": 8, "data_size": 32, "threads": 1}
    computed = reference.parity_reference.__wrapped__("cnn", **args)
    (stored,) = tmp_path.glob("*.pt")
    read = reference.parity_reference.__wrapped__("cnn", **args)
    assert list(tmp_path.glob("*.pt")) == [stored] and read is not computed
    assert read.losses == computed.losses and read.adam_lr == computed.adam_lr
    for (name, want), (same, got) in zip(computed.params.items(), read.params.items(), strict=True):
        assert name == same and torch.equal(want, got), name
    for (want_losses, want_params), (got_losses, got_params) in zip(computed.noise, read.noise, strict=True):
        assert want_losses == got_losses and all(torch.equal(want_params[n], got_params[n]) for n in want_params)
    x = reference.reference_data("cnn", 8, 1).tensors[0]
    assert torch.equal(read.net(x), computed.net(x))
    other = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", other)  # another dispatch: its own entry, not this one
    assert reference._shared_path("cnn", {**args, "optimizer": "adam", "lr": 1e-3}) != stored
