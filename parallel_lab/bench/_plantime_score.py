"""``bench plantime``'s arithmetic on its runs: the fit on the calibration set, the per-config rows,
the table and the last line (``median |error| X%; worst Y% (config); interval coverage C/N (median
half-width W%); ranking agreement K/M``)."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics

from parallel_lab.plan.calibrate import Calibration
from parallel_lab.plan.steptime import predict_step

PARTS = ("compute", "comm", "exposed_comm", "optimizer", "idle")


def _predict(calib: Calibration, overrides: list[str], config_of):
    from parallel_lab.models import build_meta_model
    from parallel_lab.strategies import get_strategy_class

    cfg = config_of(overrides)
    return predict_step(cfg, get_strategy_class(cfg.strategy.name), build_meta_model(cfg.model), calib)


def log_spread(runs: list[dict]) -> float:
    """Half the log range of a config's step over the rounds: its measured run-to-run noise."""
    steps = [r["step_s"] for r in runs]
    return math.log(max(steps) / min(steps)) / 2


def _typical(xs: list[float]) -> float:
    """The median: a round that a passing load slowed is the exception, and the interval, not the
    point, carries it (``interval_of``)."""
    xs = [x for x in xs if x >= 0 and math.isfinite(x)]
    return statistics.median(xs) if xs else 1.0


def _marginal(calib: Calibration, key: str, part: str, name: str, names, config_of, measured: float) -> float:
    """The value of the per-unit term ``scale[key]`` (seconds) that makes ``part`` of row ``name``
    what was measured, the other terms as ``calib`` has them (the model is linear in it)."""
    at = [
        _predict(dataclasses.replace(calib, scale={**calib.scale, key: v}), names[name], config_of).parts[part]
        for v in (0.0, 1e-3)
    ]
    return max(0.0, 1e-3 * (measured - at[0]) / (at[1] - at[0])) if at[1] > at[0] else 0.0


def fit(calib: Calibration, cal_runs: dict[str, list[dict]], names: dict[str, list[str]], config_of) -> Calibration:
    """The calibration set's corrections, in order: compute from the one-rank fp32 row, bf16 from the
    one-rank bf16 row, Adam from the rows without DTensor shards; contention from the several-rank
    rows without wrapper hooks against the one-rank (ranks sharing cores); then, the rest fixed, the
    wrappers' cost per hooked unit and per DTensor (``ComputeShape.hooked_units``,
    ``dtensor_optimizer``) from the rows that have them; each collective family's scale from the
    rows that use it (measured comm over the alpha-beta prediction); the share of overlapped
    communication found hidden; the interval (``interval_of``)."""
    return interval_of(_corrections(calib, cal_runs, names, config_of), calib, cal_runs)


def _corrections(calib: Calibration, cal_runs, names, config_of) -> Calibration:
    """``fit`` less the interval; what no row of ``cal_runs`` can fit keeps ``calib``'s value."""
    raw = dataclasses.replace(calib, scale={"hidden": 0.0, "unit_s": 0.0, "dtensor_step_s": 0.0}, interval_log=0.0)
    ratios: dict[str, list[float]] = {"optimizer": [], "hidden": []}
    points: dict[str, list[tuple]] = {"fp32": [], "bf16": [], "shared": []}  # (name, line s, measured s, passes)
    comm: dict[str, list[float]] = {}
    several: list[dict] = []
    for name, runs in cal_runs.items():
        cfg = config_of(names[name])
        several += runs if cfg.world_size > 1 else []
        pred = _predict(raw, names[name], config_of)
        shape = _shape(cfg)
        solo = "bf16" if "bf16" in name else "fp32" if cfg.world_size == 1 else "shared"
        for r in runs:
            m = _less_wait(r)
            if not shape.hooked_units:
                points[solo].append((name, pred.parts["compute"], m["compute"], shape.slots))
            if not shape.dtensor_optimizer:
                ratios["optimizer"].append(m["optimizer"] / pred.parts["optimizer"])
            total = sum(pred.comm_raw.values())
            if total > 0 and m["comm"] > 0:
                for op in pred.comm_raw:
                    comm.setdefault(op, []).append(m["comm"] / total)
                ratios["hidden"].append(min(1.0, max(0.0, 1 - m["exposed_comm"] / m["comm"])))
    scale = dict(calib.scale)  # what no row of this set can fit keeps its value (--calibrate-only)
    if points["fp32"]:
        scale["compute"], scale["loop_s"] = compute_line(points["fp32"])
    compute, loop = scale.get("compute", 1.0), scale.get("loop_s", 0.0)
    scale.update(unit_s=0.0, dtensor_step_s=0.0)
    beyond = {k: [(m - loop * n) / p for _, p, m, n in xs] for k, xs in points.items()}  # ratios, loop taken off
    if ratios["optimizer"]:
        scale["optimizer"] = _typical(ratios["optimizer"])
    if beyond["bf16"]:
        scale["bf16"] = _typical(beyond["bf16"]) / compute
    if comm:
        scale["comm"] = _typical([x for xs in comm.values() for x in xs])  # collectives no row used
        scale.update({f"comm_{op}": _typical(xs) for op, xs in comm.items()})
        scale["hidden"] = statistics.median(ratios["hidden"])
    scale["straggle"] = _straggle(several, calib.scale.get("straggle", 0.0))
    # contention as the several-rank rows show it beyond the one-rank compute
    contention = calib.contention * (_typical(beyond["shared"]) / compute if beyond["shared"] else 1.0)
    fitted = dataclasses.replace(calib, scale=scale, contention=max(1.0, contention), interval_log=0.0)
    return _fit_wrappers(fitted, cal_runs, names, config_of, calib.scale)


LOOP_FIT_SPREAD = 1.5  # the one-rank rows' lines must differ this much to tell a constant from a scale


def compute_line(points: list[tuple]) -> tuple[float, float]:
    """(compute, loop_s): the one-rank fp32 rows' measured compute as ``compute x line + loop_s x
    passes``, where line is the micro-benchmarks' prediction.

    One model's rows (the CPU set: all cnn) cannot tell a multiplier from a per-pass constant, so
    they fit the multiplier alone (loop_s 0). Rows of models whose lines differ by
    ``LOOP_FIT_SPREAD`` or more fit both, by least squares in relative error: on the H100 the cnn
    measured 2.4-3.1x its line and the vit 1.5x, so one multiplier from the cnn priced the vit and
    resnet18 35-50% high; what the loop costs per pass whatever it computes (the loss, the batch's
    copy, Python between launches) is that constant (docs/gpu.md). A negative fitted constant
    falls back to the multiplier alone."""
    by_name: dict[str, tuple[float, int, list[float]]] = {}
    for name, line, measured, passes in points:
        by_name.setdefault(name, (line, passes, []))[2].append(measured)
    rows = [(line, passes, statistics.median(ms)) for line, passes, ms in by_name.values()]
    lines = [line for line, _, _ in rows]
    if len(rows) >= 2 and max(lines) >= LOOP_FIT_SPREAD * min(lines):
        a = [line / m for line, _, m in rows]
        b = [n / m for _, n, m in rows]
        saa, sab, sbb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b)), sum(y * y for y in b)
        det = saa * sbb - sab * sab
        if det > 0:
            k = (sum(a) * sbb - sum(b) * sab) / det
            c = (saa * sum(b) - sab * sum(a)) / det
            if k > 0 and c >= 0:
                return k, c
    return _typical([m / line for _, line, m, _ in points]), 0.0


def _less_wait(run: dict) -> dict:
    """A run's measured parts less rank 0's wait for the slowest rank (its traced compute against
    the slowest's, ``rank_compute``), which ``steptime.straggler_wait`` predicts apart from the
    collectives' scales; a run that did not record every rank's compute keeps it inside them."""
    ranks = run.get("rank_compute") or [0.0]
    wait = max(ranks) - ranks[0]
    m = dict(run["parts"])
    m["comm"] = max(0.0, m["comm"] - wait)
    m["exposed_comm"] = max(0.0, m["exposed_comm"] - wait)
    return m


def _straggle(several: list[dict], before: float) -> float:
    """The ranks' relative speed spread ``sigma`` (``steptime.straggler_wait``) from the several-rank
    calibration runs: in each, the ranks' mean wait for the slowest over their mean compute, / E[max
    of world normals]; the median over runs. No several-rank run (--calibrate-only): ``before``;
    none that recorded every rank: 0 (the wait stays inside the collectives' scales, as the runs
    saved before ``rank_compute`` existed were fitted)."""
    from parallel_lab.plan.steptime import expected_max_normal

    if not several:
        return before
    sigmas = [
        (max(c) - statistics.fmean(c)) / statistics.fmean(c) / expected_max_normal(len(c))
        for c in (r.get("rank_compute") or [] for r in several)
        if len(c) > 1
    ]
    return statistics.median(sigmas) if sigmas else 0.0


def _shape(cfg):
    from parallel_lab.models import build_meta_model
    from parallel_lab.strategies import get_strategy_class

    return get_strategy_class(cfg.strategy.name).plan.compute_shape(cfg, build_meta_model(cfg.model))


def _fit_wrappers(fitted: Calibration, cal_runs, names, config_of, before: dict) -> Calibration:
    """``unit_s`` and ``dtensor_step_s``: each row's value that closes its compute / optimizer gap, the
    median over rows and rounds; no such row: the values ``before`` had."""
    found: dict[str, list[float]] = {"unit_s": [], "dtensor_step_s": []}
    for name, runs in cal_runs.items():
        shape = _shape(config_of(names[name]))
        for key, part, has in (
            ("unit_s", "compute", shape.hooked_units),
            ("dtensor_step_s", "optimizer", shape.dtensor_optimizer),
        ):
            if has:
                found[key] += [_marginal(fitted, key, part, name, names, config_of, r["parts"][part]) for r in runs]
    scale = {**fitted.scale, **{k: (_typical(v) if v else before.get(k, 0.0)) for k, v in found.items()}}
    return dataclasses.replace(fitted, scale=scale)


def interval_of(fitted: Calibration, calib: Calibration, cal_runs: dict[str, list[dict]]) -> Calibration:
    """The interval: this run's noise, measured now, combined with the model's error on configs
    it was never fitted on, as the last validation measured it (``calib.model_error_log``: the
    held-out rows' log errors, 5th / 50th / 95th percentile; docs/plan.md).

    The noise: each calibration row's rounds against that row's median, in log space, their 95th
    and 5th percentiles (a load only ever slows a run, so the two sides differ). The two add in
    quadrature (a config's error and a round's noise are independent) around the model's median
    error. Too few rounds (--calibrate-only): ``calib``'s interval.

    Why not the calibration rows' own residuals: in-sample, a quiet run's four rows gave x0.90 to
    x1.06 and covered 14 of 42 held-out rounds; left out one row at a time, they measure how the
    fit fares without its compute anchor or without its only FSDP row, not how an unseen config
    fares (x0.76 to x1.18 on that run, 23 of 42)."""
    noise = [
        math.log(r["step_s"] / statistics.median(x["step_s"] for x in runs)) for runs in cal_runs.values() for r in runs
    ]
    if len(noise) < 6:
        return dataclasses.replace(fitted, interval_log=calib.interval_log, interval_low_log=calib.interval_low_log)
    lo, mid, hi = calib.model_error_log
    high = mid + math.hypot(max(0.0, hi - mid), max(0.0, _quantile(noise, 0.95)))
    low = mid - math.hypot(max(0.0, mid - lo), max(0.0, -_quantile(noise, 0.05)))
    return dataclasses.replace(fitted, interval_log=max(0.0, high), interval_low_log=max(0.0, -low))


def _quantile(xs: list[float], q: float) -> float:
    """The smallest of ``xs`` with at least a share ``q`` of them at or below it."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def model_error_log(rs: list[dict]) -> list[float]:
    """The held-out rows' log errors (measured median over predicted), 5th / 50th / 95th
    percentile: what ``Calibration.model_error_log`` carries into the next run's interval."""
    errors = [math.log(r["step_s"] / r["pred"].point_s) for r in rs]
    return [_quantile(errors, q) for q in (0.05, 0.5, 0.95)]


def rows(calib: Calibration, names: dict[str, list[str]], runs: dict[str, list[dict]], config_of) -> list[dict]:
    out = []
    for name, overrides in names.items():
        if name not in runs:
            continue
        pred = _predict(calib, overrides, config_of)
        rs = runs[name]
        step = statistics.median(r["step_s"] for r in rs)
        out.append(
            {
                "name": name,
                "model": config_of(overrides).model.name,
                "pred": pred,
                "step_s": step,
                "parts": {k: statistics.median(r["parts"][k] for r in rs) for k in PARTS},
                "error": (pred.point_s - step) / step,
                "inside": sum(pred.low_s <= r["step_s"] <= pred.high_s for r in rs),
                "rounds": len(rs),
                "noise": log_spread(rs),
                "steps": [r["step_s"] for r in rs],
            }
        )
    return out


def table(rs: list[dict]) -> str:
    head = (
        "| config | predicted step ms [interval] | measured step ms (rounds) | error | inside "
        "| compute ms pred / meas | comm | exposed_comm | optimizer | idle |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rs:
        p = r["pred"]
        parts = " | ".join(f"{p.parts[k] * 1e3:.1f} / {r['parts'][k] * 1e3:.1f}" for k in PARTS)
        lines.append(
            f"| {r['name']} | {p.point_s * 1e3:.1f} [{p.low_s * 1e3:.1f}, {p.high_s * 1e3:.1f}] "
            f"| {r['step_s'] * 1e3:.1f} ({', '.join(f'{s * 1e3:.1f}' for s in r['steps'])}) "
            f"| {100 * r['error']:+.0f}% | {r['inside']}/{r['rounds']} | {parts} |"
        )
    return "\n".join(lines)


def ranking(rs: list[dict]) -> tuple[int, int]:
    """Pairs of configs of the same model whose measured steps differ by more than either's noise
    (log gap > the larger log spread): how many the prediction orders the same way."""
    agree = total = 0
    for i, a in enumerate(rs):
        for b in rs[i + 1 :]:
            if a["model"] != b["model"]:
                continue
            gap = math.log(a["step_s"] / b["step_s"])
            if abs(gap) <= max(a["noise"], b["noise"]):
                continue
            total += 1
            agree += (a["pred"].point_s > b["pred"].point_s) == (gap > 0)
    return agree, total


FLOOR_COVER = 0.90  # item 2's coverage goal: the floor is read at the same share


def noise_floor(rs: list[dict], cover: float = FLOOR_COVER) -> float:
    """The narrowest interval any prediction could have drawn around these rows, as a half-width.

    Every round's step against its own config's measured median (log), then the shortest window
    holding ``cover`` of those deviations: what an oracle that knew each config's median exactly,
    and nothing of the round to come, would still need. It is in-sample, so a lower bound. On this
    2-core VM one process's level moves ±10-20% and holds for the whole run (docs/plan.md, "The
    noise floor"): the pooled floor over 18 runs is 17%; against each config's level over all runs,
    19%."""
    devs = sorted(math.log(s / r["step_s"]) for r in rs for s in r["steps"])
    k = max(1, math.ceil(cover * len(devs)))
    widths = [math.exp(devs[i + k - 1]) - math.exp(devs[i]) for i in range(len(devs) - k + 1)]
    return min(widths) / 2


def floor_line(rs: list[dict]) -> str:
    """The line before the last: how close the interval's half-width is to the noise floor."""
    return (
        f"noise floor: around each config's own measured median, {100 * FLOOR_COVER:.0f}% of these "
        f"{sum(len(r['steps']) for r in rs)} rounds need a half-width of {100 * noise_floor(rs):.0f}% "
        "(no prediction can be narrower and cover as many)"
    )


def last_line(rs: list[dict]) -> str:
    errors = [abs(r["error"]) for r in rs]
    worst = max(rs, key=lambda r: abs(r["error"]))
    covered, n = sum(r["inside"] for r in rs), sum(r["rounds"] for r in rs)
    half = statistics.median((r["pred"].high_s - r["pred"].low_s) / 2 / r["pred"].point_s for r in rs)
    k, m = ranking(rs)
    return (
        f"median |error| {100 * statistics.median(errors):.0f}%; worst {100 * abs(worst['error']):.0f}% "
        f"({worst['name']}); interval coverage {covered}/{n} (median half-width {100 * half:.0f}%); "
        f"ranking agreement {k}/{m}"
    )


def header(calib: Calibration, runs: dict, args) -> str:
    loads = [r["loadavg_1m"] for name, rs in runs.items() if not name.startswith("_") for r in rs]
    # the machine the runs were measured on (a --replay may run elsewhere): the calibration's CPUs
    # and the rounds the runs hold
    cpus = calib.cpu_count or os.cpu_count() or 1
    rounds = max((len(rs) for name, rs in runs.items() if not name.startswith("_")), default=args.rounds)
    ops = ", ".join(
        f"{k} {1e-9 / v['per_unit_s'] if v['per_unit_s'] else math.inf:.1f} G/s + {v['per_call_s'] * 1e6:.0f} us/call"
        + (f" + {v['per_thin_s'] * 1e12:.0f} ps x FLOP/smallest dim" if v.get("per_thin_s") else "")
        for k, v in sorted(calib.ops.items())
    )
    s = calib.scale
    return (
        f"{rounds} interleaved rounds, rank 0, {calib.device}, {cpus} CPUs, 1 thread per rank; "
        f"1-min load average at run starts: median {statistics.median(loads):.2f}, max {max(loads):.2f} "
        f"(per core max {max(loads) / cpus:.2f}: {'below' if max(loads) < cpus else 'NOT below'} one per core); "
        f"{runs.get('_loadavg', [{}])[0]}\n"
        f"calibration (units: FLOP or byte per s): {ops}; Adam {calib.optimizer['per_param_s'] * 1e9:.2f} ns/param "
        f"+ {calib.optimizer['per_tensor_s'] * 1e6:.0f} us/tensor "
        f"(+ {calib.optimizer.get('dtensor_per_tensor_s', 0) * 1e6:.0f} as a DTensor); "
        f"contention {calib.contention:.2f}; "
        f"fitted on the calibration set: {', '.join(f'{k} {v:.3g}' for k, v in sorted(s.items()))}; "
        f"interval x{math.exp(-calib.interval_low_log):.2f} to x{math.exp(calib.interval_log):.2f}\n"
    )
