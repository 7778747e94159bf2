"""The step-time model's arithmetic (parallel_lab.plan.steptime, census, calibrate), in-process and
untimed: what it predicts for given calibration numbers, never how fast this machine is (that is
``python -m parallel_lab.bench plantime``'s table, docs/plan.md)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics

import pytest
import torch

from parallel_lab.models import build_meta_model, vit_sizes
from parallel_lab.models.flops import layer_flops
from parallel_lab.plan.calibrate import (
    REPLAY_DTENSOR_PER_TENSOR_S,
    VERSION,
    Calibration,
    fit_per_call,
    load_or_measure_calibration,
)
from parallel_lab.plan.census import KINDS, census_of
from parallel_lab.plan.configs import planned_configs
from parallel_lab.plan.steptime import (
    BACKWARD_SHARE,
    AlphaBeta,
    collective_seconds,
    fit_alpha_beta,
    predict_step,
)
from parallel_lab.strategies import get_strategy_class

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
FLOP_S = 1e-11  # 100 GFLOP/s
BYTE_S = 1e-10  # 10 GB/s
FLOP_KINDS = ("conv", "matmul")  # the others' units are bytes


def _calib(alpha: float = 100e-6, beta: float = 1e9, cpus: int = 8, contention: float = 1.0, **kw) -> Calibration:
    """Numbers chosen here, none measured: conv/matmul at FLOP_S per FLOP, memory at BYTE_S per
    byte, no per-call cost unless ``per_call`` says; Adam free unless ``per_param`` says."""
    per_call = kw.pop("per_call", 0.0)
    ops = {
        f"{k}@{d}": {"per_call_s": per_call, "per_unit_s": FLOP_S if k in FLOP_KINDS else BYTE_S}
        for k in KINDS
        for d in ("fp32", "bf16")
    }
    fits = {op: {"alpha_s": alpha, "beta_Bps": beta} for op in OPS}
    kw.setdefault("scale", {"hidden": 0.5})  # every other correction 1: the lines alone
    kw.setdefault("interval_log", 0.15)
    kw.setdefault("interval_low_log", 0.1)
    return Calibration(
        cpu_count=cpus,
        ops=ops,
        optimizer={"per_param_s": kw.pop("per_param", 0.0), "per_tensor_s": 0.0},
        contention=contention,
        collectives={"gloo": fits, "hand": fits},
        **kw,
    )


@functools.cache  # composing a config costs ~0.3 s: each one once
def _cfg(strategy: str, *extra: str):
    (planned,) = planned_configs(
        [f"strategy={strategy}", "model=cnn", "world_size=2", "trainer.global_batch=64", *extra]
    )
    return planned.cfg


@functools.cache
def _model(name: str = "cnn"):
    return build_meta_model(_cfg("ddp", f"model={name}").model)


def _predict(strategy: str, calib: Calibration, *extra: str):
    return predict_step(_cfg(strategy, *extra), get_strategy_class(strategy), _model(), calib)


def _pass_seconds(batch: int) -> float:
    c = census_of(_model(), batch)
    return sum(c.units[k] * (FLOP_S if k in FLOP_KINDS else BYTE_S) for k in KINDS)


def test_fits_recover_the_lines_they_were_given():
    alpha, beta = 80e-6, 1.5e9
    sizes = [4096 * 4**k for k in range(7)]
    fit = fit_alpha_beta([(s, alpha + s / beta) for s in sizes])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6) and fit.beta_Bps == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta([(4096, 1e-4)])
    line = fit_per_call([(c, u, c * 3e-5 + u * 2e-11) for c, u in ((2, 1e6), (2, 1e8), (4, 1e9))])
    assert line["per_call_s"] == pytest.approx(3e-5, rel=1e-6) and line["per_unit_s"] == pytest.approx(2e-11, rel=1e-6)
    # a thin-operator term that the points say costs nothing more is dropped, never negative
    pts = [
        (c, u, th, c * 3e-5 + u * 2e-11 - th * 1e-13)
        for c, u, th in ((2, 1e6, 1e4), (2, 1e8, 1e5), (4, 1e9, 1e8), (3, 5e8, 1e6))
    ]
    thin = fit_per_call(pts)
    assert thin["per_thin_s"] == 0.0 and thin["per_unit_s"] > 0
    without = fit_per_call([(c, u, t) for c, u, _, t in pts])  # the two-term fit: what the rest refits to
    assert thin["per_call_s"] == pytest.approx(without["per_call_s"]) and thin["per_unit_s"] == pytest.approx(
        without["per_unit_s"]
    )


def test_census_counts_forward_and_both_gradients_of_every_conv():
    """Backward of a conv computes the input's and the weight's gradient (2x forward each); the
    first conv's input is the data, which needs no gradient: 3F per conv, 2F for the first."""
    model = _model()
    flops = layer_flops(model, 16)
    convs = [name for name, m in model.named_modules() if type(m).__name__ == "Conv2d"]
    census = census_of(model, 16)
    assert census.calls["conv"] == 2 * len(convs)
    assert census.units["conv"] == pytest.approx(3 * sum(flops[n] for n in convs) - flops[convs[0]])
    assert census.units["memory"] > 0 and census.calls["memory"] > 0


def test_ddp_step_is_compute_plus_exposed_alpha_beta_per_bucket():
    alpha, beta = 100e-6, 1e9
    pred = _predict("ddp", _calib(alpha, beta))
    params = sum(p.numel() for p in _model().parameters())
    payload = 4 * params  # one all-reduce of every fp32 gradient
    # one bucket: torch's first bucket is bucket_cap_mb (25 MiB) when the option is passed, and
    # the 1.3 MB of gradients fit it (test_spine.py checks the real reducer's count)
    assert payload < 25 * 2**20
    buckets = 1
    comm = buckets * alpha + payload / beta
    compute = _pass_seconds(32)  # each of 2 ranks: 32 of the 64 samples
    assert pred.parts["compute"] == pytest.approx(compute)
    assert pred.parts["comm"] == pytest.approx(comm)
    # DDP all-reduces during backward: the calibrated share (0.5) of it is hidden.
    assert pred.parts["exposed_comm"] == pytest.approx(comm - min(0.5 * comm, BACKWARD_SHARE * compute))
    assert pred.point_s == pytest.approx(compute + pred.parts["exposed_comm"] + pred.parts["optimizer"])
    assert pred.low_s == pytest.approx(pred.point_s * math.exp(-0.1))  # the interval's two sides
    assert pred.high_s == pytest.approx(pred.point_s * math.exp(0.15))


def test_more_bytes_or_a_slower_link_predict_a_longer_step():
    calib = _calib(50e-6, 1e9)
    ddp, zero1 = _predict("ddp", calib), _predict("zero1", calib)
    assert ddp.parts["compute"] == pytest.approx(zero1.parts["compute"])
    assert zero1.parts["comm"] > ddp.parts["comm"]  # 3 psi against 2 psi
    assert _predict("ddp", _calib(50e-6, 0.5e9)).point_s > ddp.point_s
    unbucketed = _predict("manual_ddp", calib, "strategy.bucketed=false")
    assert unbucketed.parts["exposed_comm"] == pytest.approx(unbucketed.parts["comm"])  # after backward


def test_ring_extrapolation_to_more_ranks():
    fit = AlphaBeta(1e-4, 1e9)
    at2, at4 = (collective_seconds(fit, "all_reduce", 1e6, 1, w) for w in (2, 4))
    assert at4 == pytest.approx((3 * 1e-4, 1.5 * 1e6 / 1e9))  # 6 steps not 2, 2(N-1)/N = 1.5 not 1
    assert sum(at2) == pytest.approx(fit.seconds(1e6))
    assert sum(collective_seconds(fit, "p2p", 1e6, 4, 4)) == pytest.approx(fit.seconds(1e6, 4))


def test_ranks_sharing_cores_slow_each_other():
    """world 4 on 2 cores: each rank gets half a core (timeslice 2), which already includes what
    sharing costs (the larger of timeslice and contention); on 8 cores only the contention remains;
    a background load of 2 on 2 cores halves a world-2 rank's core."""
    free = dict(alpha=0.0, beta=1e15)  # no communication: every rank busy all the time
    roomy = _predict("ddp", _calib(cpus=8, contention=1.3, **free), "world_size=4")
    crowded = _predict("ddp", _calib(cpus=2, contention=1.3, **free), "world_size=4")
    assert roomy.parts["compute"] == pytest.approx(1.3 * _pass_seconds(16))
    assert crowded.parts["compute"] == pytest.approx(2 * _pass_seconds(16))
    loaded = predict_step(_cfg("ddp"), get_strategy_class("ddp"), _model(), _calib(cpus=2, **free), background_load=2.0)
    assert loaded.parts["compute"] == pytest.approx(2 * _pass_seconds(32))
    # Data-parallel ranks compute in lockstep: slow collectives lend no core to a computing rank.
    waiting = _predict("ddp", _calib(cpus=2, contention=1.3, alpha=0.0, beta=2e7), "world_size=4")
    assert waiting.parts["exposed_comm"] > waiting.parts["compute"] / 2
    assert waiting.parts["compute"] == pytest.approx(crowded.parts["compute"])


def test_idle_pipeline_stages_lend_their_cores():
    """A pipeline stage idling in a bubble yields its core: four stages on 2 cores time-slice by
    the non-idle share of the step, less than the two-fold of four ranks always busy."""
    free = dict(alpha=0.0, beta=1e15)
    roomy = _predict("pp", _calib(cpus=8, contention=1.0, **free), "world_size=4", "strategy.stages=4")
    crowded = _predict("pp", _calib(cpus=2, contention=1.0, **free), "world_size=4", "strategy.stages=4")
    share = 1 - crowded.parts["idle"] / crowded.point_s
    assert 0 < crowded.parts["idle"] and share < 1
    assert crowded.parts["compute"] == pytest.approx(max(1.0, 4 * share / 2) * roomy.parts["compute"], rel=0.02)
    assert roomy.parts["compute"] < crowded.parts["compute"] < 2 * roomy.parts["compute"]


def test_sharded_optimizer_updates_half():
    calib = _calib(per_param=1e-8)
    assert _predict("zero1", calib).parts["optimizer"] == pytest.approx(
        _predict("ddp", calib).parts["optimizer"] / 2, rel=1e-3
    )


def test_pipeline_idles_p_minus_one_slots():
    pred = _predict("pp", _calib(alpha=0.0, beta=1e15))
    m, p = _cfg("pp").strategy.microbatches, _cfg("pp").strategy.stages
    busy, idle = pred.parts["compute"], pred.parts["idle"]
    assert idle / (busy + idle) == pytest.approx((p - 1) / (m + p - 1))
    assert busy + idle > _pass_seconds(64) / 2  # never faster than half the work on one rank


def test_calibration_round_trips_and_is_read_from_its_cache(tmp_path):
    calib = _calib(contention=1.7, scale={"compute": 1.2, "comm": 0.9, "hidden": 0.3})
    assert Calibration.from_json(calib.to_json()) == calib
    path = tmp_path / "calibration.json"
    path.write_text(calib.to_json())
    assert load_or_measure_calibration(path) == calib  # read, not measured
    with pytest.raises(ValueError, match="version"):
        Calibration.from_json(calib.to_json().replace(f'"version": {VERSION}', '"version": 0'))


def test_bench_scoring_counts_only_rankings_above_noise():
    """bench plantime's arithmetic: a pair whose gap is inside the noise is not a ranking; pairs of
    different models are never compared; the last line's fields."""
    from types import SimpleNamespace

    from parallel_lab.bench import _plantime_score as score

    def row(name, pred, steps, model="cnn"):
        point = SimpleNamespace(point_s=pred, low_s=pred / 1.1, high_s=pred * 1.1)
        step = sorted(steps)[len(steps) // 2]
        return {"name": name, "model": model, "pred": point, "step_s": step, "steps": steps,
                "error": (pred - step) / step, "inside": sum(pred / 1.1 <= s <= pred * 1.1 for s in steps),
                "rounds": len(steps), "noise": score.log_spread([{"step_s": s} for s in steps])}  # fmt: skip

    rs = [
        row("a", 1.0, [1.0, 1.02]),
        row("b", 2.2, [2.0, 2.04]),  # b > a by far more than the noise: ordered right
        row("c", 0.9, [1.01, 1.03]),  # c vs a: inside a's and c's noise, not counted
        row("d", 0.5, [3.0, 3.1]),  # d is slowest measured, predicted fastest: wrong twice over
        row("e", 5.0, [0.1, 0.1], model="vit"),  # another model: never paired
    ]
    assert score.ranking(rs) == (2, 5)  # a<b, c<b right; a<d, b<d, c<d wrong; a~c not counted
    line = score.last_line(rs)
    assert line.startswith("median |error| 13%; worst 4900% (e); interval coverage 4/10 (median half-width ")
    assert line.endswith("; ranking agreement 2/5")


def test_recompute_counts_the_forward_it_replays():
    """trainer.recompute runs the checkpointed regions' forward again inside backward: the census
    counts those operators (more under full than selective), never more than one forward of the
    blocks (counted here on its own, outside any checkpoint; torch stops replaying once backward has
    what it needs, so full replays a little less than the whole forward)."""
    from parallel_lab.plan.census import _Counter

    model = _model("vit")
    none, selective, full = (census_of(model, 8, torch.float32, mode) for mode in ("none", "selective", "full"))
    x = torch.empty(8, 3, 32, 32, device="meta")
    counter = _Counter()
    with torch.no_grad():
        x = model.embed(x)
        with counter:
            for name, block in model.named_children():
                if name.startswith("block"):
                    x = block(x)
    forward = counter.census.units["matmul"]
    extra = {mode: c.units["matmul"] - none.units["matmul"] for mode, c in (("selective", selective), ("full", full))}
    assert 0 < extra["selective"] < extra["full"] <= forward, (extra, forward)


def test_wrappers_pay_per_hooked_unit_and_per_dtensor():
    """FSDP's units (cnn: block1-3, fc1, fc2, then the root) and ZeRO-3's parameter-owning modules
    (the same five, and the root) run hooks around every pass: ``unit_s`` each; FSDP2's optimizer
    steps DTensors: the measured ``dtensor_per_tensor_s`` per tensor and ``dtensor_step_s`` once
    (FSDP1's flat parameters are plain tensors). DDP and ZeRO-2 hook nothing of the kind."""
    calib = _calib(scale={"hidden": 0.5, "unit_s": 1e-3, "dtensor_step_s": 5e-3})
    calib.optimizer["dtensor_per_tensor_s"] = 1e-4
    ddp = _predict("ddp", calib).parts
    units, tensors = 6, len(list(_model().parameters()))
    fsdp_opt = tensors * 1e-4 + 5e-3
    for strategy, extra_compute, extra_opt in (("fsdp", units, fsdp_opt), ("zero3", units, 0), ("zero2", 0, 0)):
        parts = _predict(strategy, calib).parts
        assert parts["compute"] == pytest.approx(ddp["compute"] + extra_compute * 1e-3), strategy
        assert parts["optimizer"] == pytest.approx(extra_opt), strategy  # Adam itself free here
    assert _predict("fsdp", calib, "strategy.version=1").parts["optimizer"] == 0.0
    two = _predict("fsdp", calib, "trainer.grad_accum=2").parts["compute"]  # the hooks run every pass
    assert two == pytest.approx(2 * (_pass_seconds(16) + units * 1e-3))


def test_collectives_take_their_ring_time_whatever_the_cores():
    """More ranks than cores: the collectives still take their ring time (measured at world 3 and 4
    on 2 cores: a factor of ranks / cores over-predicted them; docs/plan.md), and world 4's ring
    moves 1.5x world 2's bytes per rank."""
    four = {cpus: _predict("ddp", _calib(cpus=cpus, alpha=0.0), "world_size=4").parts["comm"] for cpus in (2, 8)}
    assert four[2] == pytest.approx(four[8])
    assert four[2] == pytest.approx(1.5 * _predict("ddp", _calib(cpus=8, alpha=0.0)).parts["comm"])


def test_bench_fit_recovers_the_corrections_that_made_its_runs():
    """bench plantime's fit on runs a known calibration predicts (3 rounds each, one 5% fast and one
    20% slow): it recovers compute, bf16, Adam, contention (from the hook-free rows only), the cost
    per hooked unit and per DTensor, the collective families' scales, and the interval's two sides
    (a load only slows a run: 1.2 above, 0.95 below) with the model's held-out error."""
    from parallel_lab.bench import _plantime_score as score
    from parallel_lab.bench import plantime

    config_of = functools.cache(lambda overrides: plantime.config_of(list(overrides)))
    names = {n: tuple(o) for n, o in plantime.CALIBRATION.items()}
    scale = {"compute": 1.1, "bf16": 0.9, "optimizer": 2.0, "hidden": 0.0, "unit_s": 2e-3, "dtensor_step_s": 3e-3}
    scale.update(comm=2.5, comm_all_reduce=3.0, comm_all_gather=2.5, comm_reduce_scatter=2.5, straggle=0.08)
    truth = _calib(cpus=2, contention=1.2, scale=scale, per_param=1e-9)
    runs = {}
    for name, overrides in names.items():
        pred = score._predict(truth, overrides, config_of)
        runs[name] = [{"step_s": pred.point_s * k, **_ranks_spread(pred, 0.08)} for k in (0.95, 1.0, 1.2)]
    fitted = score.fit(dataclasses.replace(truth, scale={}, contention=1.0), runs, names, config_of)
    assert fitted.contention == pytest.approx(1.2)
    for key, want in scale.items():
        assert fitted.scale[key] == pytest.approx(want, abs=1e-12), key
    # The interval: the rounds' noise (1.2 above, 0.95 below the median) alone where the model had no
    # held-out error, and combined in quadrature with the held-out errors around their median.
    exact = score.fit(dataclasses.replace(truth, model_error_log=[0.0, 0.0, 0.0]), runs, names, config_of)
    assert (exact.interval_log, exact.interval_low_log) == pytest.approx((math.log(1.2), -math.log(0.95)))
    erring = score.fit(dataclasses.replace(truth, model_error_log=[-0.1, 0.02, 0.2]), runs, names, config_of)
    assert erring.interval_log == pytest.approx(0.02 + math.hypot(0.18, math.log(1.2)))
    assert erring.interval_low_log == pytest.approx(-0.02 + math.hypot(0.12, math.log(0.95)))
    off = score.fit(dataclasses.replace(truth, scale={**scale, "unit_s": 0.0}), runs, names, config_of)
    assert off.scale["unit_s"] == pytest.approx(2e-3)  # fitted on fsdp cnn, whatever it started from


def _ranks_spread(pred, sigma: float) -> dict:
    """A run's parts and per-rank compute where the two ranks' speeds spread by ``sigma``: rank 1
    slower, so rank 0 waits out the whole gap, not the expected wait the prediction holds."""
    from parallel_lab.plan.steptime import expected_max_normal

    parts, c0 = dict(pred.parts), pred.parts["compute"]
    if pred.parts["comm"] == 0:  # one rank
        return {"parts": parts, "rank_compute": [c0]}
    half = sigma * expected_max_normal(2)
    c1 = c0 * (1 + half) / (1 - half)  # (max - mean) / mean = half
    extra = (c1 - c0) - half * c0  # the actual wait over the predicted one
    parts.update(comm=parts["comm"] + extra, exposed_comm=parts["exposed_comm"] + extra)
    return {"parts": parts, "rank_compute": [c0, c1]}


def test_a_rank_waits_for_the_slowest_in_proportion_to_its_compute():
    """steptime.straggler_wait: sigma x E[max of world normals] x the rank's compute, in comm and
    exposed_comm; none for one process, a pipeline (its bubbles are idle) or without a fit; runs
    that did not record every rank's compute fit sigma 0, keeping the wait inside the comm scales."""
    from parallel_lab.bench import _plantime_score as score
    from parallel_lab.plan.steptime import expected_max_normal

    assert [round(expected_max_normal(n), 3) for n in (1, 2, 3, 4)] == [0.0, 0.564, 0.846, 1.029]
    calib = _calib(cpus=8, scale={"hidden": 0.5, "straggle": 0.1})
    off = _calib(cpus=8)
    for strategy, extra, world in (("tp", (), 2), ("ddp", (), 2), ("ddp", ("world_size=4",), 4)):
        on, no = _predict(strategy, calib, *extra), _predict(strategy, off, *extra)
        wait = 0.1 * expected_max_normal(world) * on.parts["compute"]
        assert on.parts["exposed_comm"] - no.parts["exposed_comm"] == pytest.approx(wait)
        assert on.parts["comm"] - no.parts["comm"] == pytest.approx(wait)
    assert _predict("pp", calib).parts["exposed_comm"] == pytest.approx(_predict("pp", off).parts["exposed_comm"])
    assert _predict("ddp", calib, "world_size=1").parts["exposed_comm"] == 0
    assert score._straggle([{"step_s": 1.0, "parts": {}}], before=0.3) == 0.0
    assert score._straggle([], before=0.3) == 0.3
    c = [1.0, 1.1, 1.3, 1.2]  # mean 1.15: the ranks wait 0.15 on average
    assert score._straggle([{"rank_compute": c}], 0.0) == pytest.approx(0.15 / 1.15 / expected_max_normal(4))


def test_held_out_errors_carry_into_the_next_interval():
    """bench plantime's validation: the held-out rows' log errors (measured over predicted) at the
    5th, 50th and 95th percentile, what the next run's interval carries."""
    from types import SimpleNamespace

    from parallel_lab.bench import _plantime_score as score

    rows = [{"step_s": 1.0 + i / 100, "pred": SimpleNamespace(point_s=1.0)} for i in range(-10, 31)]
    assert score.model_error_log(rows) == pytest.approx([math.log(0.92), math.log(1.1), math.log(1.28)])


def test_older_calibrations_are_replayed_with_this_versions_defaults():
    """``bench plantime --replay`` of an older run: its measurements kept, scale and interval this
    version's (the fit redoes them); a version-1 file (no pool or norm kind) is refused."""
    old = json.loads(_calib(contention=1.4).to_json())
    old.update(version=VERSION - 1, scale={"compute": 9.0})
    upgraded = Calibration.upgraded(old)
    assert upgraded.contention == 1.4 and upgraded.version == VERSION and upgraded.scale["compute"] != 9.0
    assert upgraded.optimizer["dtensor_per_tensor_s"] == REPLAY_DTENSOR_PER_TENSOR_S  # unmeasured before 4
    del old["ops"]["pool@fp32"]
    with pytest.raises(ValueError, match="pool and norm"):
        Calibration.upgraded(old)


def test_bench_rounds_rotate_and_run_the_calibration_set_twice(monkeypatch, tmp_path):
    """bench plantime's schedule: one discarded run first, then each round every config once in an
    order rotated by one, and the calibration set (``twice``) again at the round's end. The runs
    themselves are replaced by a recorder: this checks the order, not a measurement."""
    from types import SimpleNamespace

    from parallel_lab.bench import plantime

    calls = []

    def record(overrides, steps, workdir, timeout, device):
        calls.append(overrides[0])
        return {"step_s": 1.0, "parts": {}, "loadavg_1m": 0.0}

    monkeypatch.setattr(plantime, "run_once", record)
    names = {n: [n] for n in ("a", "b", "c")}
    args = SimpleNamespace(rounds=2, steps=20, timeout=1.0, device="cpu", out=None)
    out = plantime.measure(names, args, tmp_path, twice=("a",))
    assert calls == ["a", "a", "b", "c", "a", "b", "c", "a", "a"]
    assert {n: len(rs) for n, rs in out.items()} == {"a": 4, "b": 2, "c": 2}


def _bench_times(censuses: dict, null_s: float, lines: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Every micro-benchmark's seconds as these per-call / per-unit lines and a null pass of
    ``null_s`` make them: the pass once, each kind's calls beyond the null pass's, its units."""
    out = {}
    for (d, kind, i), census in censuses.items():
        null = censuses[d, "pass", 0]
        t = null_s
        if kind != "pass":
            for k, (call, unit) in lines.items():
                calls = census.calls[k] - null.calls[k]
                own = kind == k
                t += (max(1, calls) if own else calls) * call + (census.units[k] if own or k == "memory" else 0) * unit
        out[f"{d} {kind} {i}"] = t
    return out


def test_the_null_pass_is_paid_once_per_pass_not_per_call():
    """``calibrate.fit_ops`` takes the null pass (autograd's start, the sum, its seed: what any pass
    pays) off every benchmark before it fits the lines, and the model charges it once per pass
    (``Calibration.pass_s``). Left in (``null_pass=False``), a kind benchmarked with one call per
    pass is charged it on every call: the matmul line's per-call cost comes out well above its
    own, as on the H100 (docs/gpu.md)."""
    from parallel_lab.plan.calibrate import bench_censuses, fit_ops

    censuses = bench_censuses()
    lines = {"memory": (5e-6, BYTE_S), "matmul": (10e-6, FLOP_S), "conv": (20e-6, FLOP_S)}
    lines |= {"pool": (3e-6, BYTE_S), "norm": (4e-6, BYTE_S)}
    raw = _bench_times(censuses, 100e-6, lines)
    ops = fit_ops(raw, censuses)
    for kind, (call, unit) in lines.items():
        if kind == "pool":  # its three benchmarks move the same bytes: only their sum is fixed
            fit = ops["pool@fp32"]
            units = censuses["fp32", "pool", 0].units["pool"]
            assert 2 * fit["per_call_s"] + units * fit["per_unit_s"] == pytest.approx(2 * call + units * unit)
            continue
        assert ops[f"{kind}@fp32"]["per_call_s"] == pytest.approx(call, rel=1e-3), kind
        assert ops[f"{kind}@fp32"]["per_unit_s"] == pytest.approx(unit, rel=1e-3), kind
    assert fit_ops(raw, censuses, null_pass=False)["matmul@fp32"]["per_call_s"] > 1.3 * lines["matmul"][0]
    # the model: one pass per micro-batch, whatever the model computes
    base = _calib()
    with_pass = dataclasses.replace(base, pass_s=1e-3)
    one = (
        _predict("single", with_pass, "world_size=1").parts["compute"]
        - _predict("single", base, "world_size=1").parts["compute"]
    )
    assert one == pytest.approx(1e-3)
    two = _predict("single", with_pass, "world_size=1", "trainer.grad_accum=2").parts["compute"]
    assert two - _predict("single", base, "world_size=1", "trainer.grad_accum=2").parts["compute"] == pytest.approx(
        2e-3
    )


def test_a_gpu_benchmarks_each_shape_at_a_larger_batch_too():
    """On a GPU the CPU's sizes are all launch-bound: each benchmark also runs at GPU_BATCH x its batch."""
    from parallel_lab.plan.calibrate import BENCHES, GPU_BATCH, benches_for

    assert benches_for("cpu") == BENCHES
    for kind, benches in benches_for("cuda:0").items():
        cpu = [shape for _, shape in BENCHES[kind]]
        assert [shape for _, shape in benches] == cpu + [(s[0] * GPU_BATCH, *s[1:]) for s in cpu], kind


def test_dtensor_dispatch_is_measured_per_tensor_and_fails_when_it_is_not_there():
    """``measure_dtensor_optimizer`` times the runs' Adam on DTensor shards against the same plain
    tensors: DTensor's dispatch costs every tensor tens of us on a CPU, more than plain Adam's own
    step. Seen failing with plain tensors on both sides (no DTensor: 0 per tensor)."""
    from parallel_lab.plan import optimizer_calibration as bench

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the calibration measures it
    try:
        per_tensor = bench.measure_dtensor_optimizer("cpu")
        step = bench.adam_step([torch.zeros(1024) for _ in range(bench.DTENSOR_BENCH_TENSORS)], "cpu")
        plain = min(step() for _ in range(5))
    finally:
        torch.set_num_threads(threads)
    # The upper bound only catches a unit slip (seconds for ms): a loaded CPU measured 2.2 ms here.
    assert 10e-6 < per_tensor < 50e-3, per_tensor
    assert per_tensor * bench.DTENSOR_BENCH_TENSORS > 0.5 * plain  # dispatch is the larger part
    import torch.distributed as dist

    assert not dist.is_initialized()  # the one-rank group it opened is closed again


def test_loop_cost_is_told_from_the_compute_scale_only_with_two_models():
    """``compute_line``: one-rank rows of two models whose lines differ fit ``compute x line +
    loop_s x passes`` (three rounds each, one 10% slow); rows of one model fit the multiplier alone
    (a constant and a scale cannot be told apart on one line), and so do two lines too close."""
    from parallel_lab.bench._plantime_score import LOOP_FIT_SPREAD, compute_line

    def rows(lines: dict[str, float], k: float, c: float) -> list[tuple]:
        return [(n, line, (k * line + c) * f, 1) for n, line in lines.items() for f in (1.0, 1.0, 1.1)]

    k, c = compute_line(rows({"cnn": 1.9e-3, "vit": 13.8e-3}, 1.3, 2e-3))
    assert (k, c) == (pytest.approx(1.3, rel=1e-6), pytest.approx(2e-3, rel=1e-6))
    one_model = rows({"cnn": 1.9e-3, "cnn b256": 1.9e-3 * (LOOP_FIT_SPREAD - 0.1)}, 1.3, 2e-3)
    k, c = compute_line(one_model)
    assert c == 0.0 and k == pytest.approx(statistics.median(m / line for _, line, m, _ in one_model))


def test_noise_floor_is_the_shortest_window_around_each_configs_own_median():
    """bench plantime's floor: rounds against their own config's measured median, the narrowest
    window holding 90% of them. The reference is brute force over every pair of deviations."""
    from types import SimpleNamespace

    from parallel_lab.bench import _plantime_score as score

    def row(steps):
        return {"step_s": statistics.median(steps), "steps": steps, "pred": SimpleNamespace(point_s=1.0)}

    # one config: 19 rounds spread over +-5% and one far slow round; another: three rounds on its
    # median and one far fast round. 24 rounds, 22 to hold: both far ones fall outside.
    rs = [
        row([math.exp(0.05 * (i - 9) / 9) for i in range(19)] + [math.exp(0.8)]),
        row([2.0, 2.0, 2.0, 2.0 * math.exp(-0.6)]),
    ]
    devs = [math.log(s / r["step_s"]) for r in rs for s in r["steps"]]
    need = math.ceil(0.9 * len(devs))
    best = (
        min(math.exp(hi) - math.exp(lo) for lo in devs for hi in devs if sum(lo <= d <= hi for d in devs) >= need) / 2
    )
    assert score.noise_floor(rs) == pytest.approx(best)
    assert score.noise_floor(rs) < 0.05  # the far rounds left out, not averaged in
    assert f"of these 24 rounds need a half-width of {100 * best:.0f}%" in score.floor_line(rs)
    # every round: the far ones must be inside
    assert score.noise_floor(rs, cover=1.0) == pytest.approx((math.exp(max(devs)) - math.exp(min(devs))) / 2)


def test_a_cached_calibration_serves_the_dtypes_it_holds_only(tmp_path, monkeypatch):
    """The recommender of an fp32 run measures fp32 only; a caller that needs bf16 measures again."""
    from parallel_lab.plan import calibrate

    full = _calib()
    fp32 = dataclasses.replace(full, ops={k: v for k, v in full.ops.items() if k.endswith("@fp32")})
    assert calibrate.measured_dtypes(full) == {"fp32", "bf16"} and calibrate.measured_dtypes(fp32) == {"fp32"}
    path = tmp_path / "calibration.json"
    path.write_text(fp32.to_json())
    assert load_or_measure_calibration(path, dtypes=("fp32",)) == fp32  # read, not measured

    def measure(device: str, dtypes: tuple[str, ...]) -> None:
        raise LookupError(f"measured {dtypes}")

    monkeypatch.setattr(calibrate, "measure_calibration", measure)
    with pytest.raises(LookupError, match="bf16"):
        load_or_measure_calibration(path)  # every dtype: bf16 is missing, so it is measured


@pytest.mark.parametrize(
    "strategy, extra, tp",
    [("ddp", (), 1), ("fsdp", (), 1), ("fsdp", ("strategy.tp=2", "world_size=4"), 2)],
)
def test_a_cp_rank_computes_its_tokens_share_of_the_vit(strategy, extra, tp):
    """strategy.cp=2 on the vit (T = 64 tokens of dim h, patch p, MLP width f, 10 classes), the
    forward's multiply-adds derived here: the patch convolution 2 T h 3p^2 on whole images and the
    classifier 2 h 10 on the pooled vector, on every cp rank; per block q, k, v, proj 4 x 2 T h^2,
    fc1 and fc2 2 x 2 T h f and the attention core's two products 2 x 2 T^2 h, of which a cp rank
    computes its T/2 queries' half (against all T keys), and under tp=2 half of that again. The
    step's compute is that share of the whole vit's pass at the replica's micro-batch (the cp ranks
    read the same samples)."""
    cfg = planned_configs(
        ["model=vit", f"strategy={strategy}", "strategy.cp=2", "world_size=2", "trainer.global_batch=64", *extra]
    )[0].cfg
    s = vit_sizes(cfg.model)
    h, p, f, tokens = s["dim"], s["patch"], int(s["dim"] * s["mlp_ratio"]), (32 // s["patch"]) ** 2
    whole = 2 * tokens * h * 3 * p * p + 2 * h * 10
    block = 4 * 2 * tokens * h * h + 2 * 2 * tokens * h * f + 2 * 2 * tokens * tokens * h
    share = (whole + s["depth"] * block / (2 * tp)) / (whole + s["depth"] * block)
    model = build_meta_model(cfg.model)
    shape = get_strategy_class(strategy).plan.compute_shape(cfg, model)
    assert shape.micro_batch == 64 // (cfg.world_size // (2 * tp)) and shape.flop_share == pytest.approx(share)
    if strategy == "ddp":
        census = census_of(model, shape.micro_batch)
        one_pass = sum(census.units[k] * (FLOP_S if k in FLOP_KINDS else BYTE_S) for k in KINDS)
        pred = predict_step(cfg, get_strategy_class(strategy), model, _calib())
        assert pred.parts["compute"] == pytest.approx(share * one_pass)
