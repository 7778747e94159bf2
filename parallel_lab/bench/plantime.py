"""Step time, predicted by the per-operator model, against real profiled runs it never saw.

    python -m parallel_lab.bench plantime [--quick] [--rounds 3] [--steps 20] [--out plantime.json]
                                          [--replay plantime.json] [--calibration runs/calibration.json]
    python -m parallel_lab.bench plantime --calibrate-only --device cuda --out calibration.json
    python -m parallel_lab.bench plantime --world1 --device cuda --rounds 2 --out plantime_gpu.json

1. The machine's quick calibration (``parallel_lab.plan.calibrate``: operator micro-benchmarks,
   Adam, two-process contention and collectives; a few seconds, no training run).
2. Real runs through the CLI, ``trainer.profile=true`` (rank 0's ``ranks[0].time_ms``: compute,
   comm, exposed_comm, optimizer, idle, other), ``--rounds`` interleaved rounds so that drifting
   load hits every config alike and the spread between rounds is the measured noise:
   - the calibration set (``conf/bench/plantime.yaml``'s ``calibration``), run twice per round
     (a run's level moves ±10-20% as a whole on a 2-core VM, and every held-out row inherits this
     set's medians; docs/plan.md): the only runs the model is fitted on (``_plantime_score.fit``:
     compute, bf16, Adam and each collective family's scale, the ranks' contention, the wrappers'
     cost per hooked unit and per DTensor, the share of overlapped communication hidden; the
     interval: the noise of these rows' rounds combined with the model's error on held-out configs
     in the last validation, ``Calibration.model_error_log``);
   - the held-out set (its ``held_out``): other models, world 3/4, bf16, micro-batches, offload,
     bucket sizes, every other strategy: predicted from that fit, never fitted on.
3. A table per config: predicted parts beside measured parts, the interval, the error; the noise
   floor (``_plantime_score.noise_floor``: the half-width that even each config's own measured
   median would need to hold 90% of the rounds); then the last line (docs/plan.md): ``median
   |error| X%; worst Y% (config); interval coverage C/N (median half-width W%); ranking agreement
   K/M``.

The measured step is the profile's ``unprofiled_step_s``: the median of the steps after the 4
warm-up steps and the 2 traced ones (14 of the default 20; with 4 timed steps after 2 warm-up ones,
the runs were still warming and one hiccup moved a run's figure by up to 40%: docs/plan.md). A first
run before round 1 is discarded (the first run after the calibration ran 15-30% slow in every saved
bench). Measured parts are the traced steps' ``time_ms`` rescaled to that step (the profiler's
own cost spread pro rata); "compute" is the profiler's compute + other (Python between operators
is the per-call cost the model's lines include).

``--calibrate-only``: step 1 and the world-1 rows of the calibration set, with ``world1_calibration``
(FSDP at one rank: the wrappers' per-unit and per-DTensor cost), each once per round, on
``--device`` (a GPU machine: ``benchmarks/plantime_device.sh``), fitted and written to ``--out``; no
held-out runs. ``--world1``: the same calibration, then the held-out world-1 rows
(``world1_held_out``: other models and the wrappers' own cost at one rank), what a one-GPU machine
can validate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from parallel_lab.bench import _plantime_score as score


def _runs() -> dict:
    """conf/bench/plantime.yaml: the calibration set, the held-out set and the --quick subset (the
    file, not this module, names the strategies: only strategies/ may)."""
    from omegaconf import OmegaConf

    from parallel_lab.config import CONF_DIR

    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "bench" / "plantime.yaml"))


RUNS = _runs()
CALIBRATION: dict[str, list[str]] = RUNS["calibration"]
HELD_OUT: dict[str, list[str]] = RUNS["held_out"]
QUICK: list[str] = RUNS["quick"]
WORLD1: dict[str, list[str]] = RUNS["world1_held_out"]
WORLD1_CAL: dict[str, list[str]] = RUNS["world1_calibration"]
ALL_CAL: dict[str, list[str]] = {**CALIBRATION, **WORLD1_CAL}
ALL_HELD: dict[str, list[str]] = {**HELD_OUT, **WORLD1}
BASE = [
    "model=cnn",
    "world_size=2",
    "trainer.global_batch=64",
    "trainer.eval_batches=0",
    "trainer.warmup_steps=4",
    "trainer.profile=true",
]


def config_of(overrides: list[str]):
    """The validated config the planner would see for these overrides (later ones win)."""
    from parallel_lab.plan.configs import planned_configs

    (planned,) = planned_configs([o for o in BASE if o != "trainer.profile=true"] + overrides)
    return planned.cfg


def run_once(overrides: list[str], steps: int, workdir: Path, timeout: float, device: str) -> dict:
    """One profiled run; rank 0's unprofiled step, its traced parts rescaled to it, the load."""
    from parallel_lab.cli.run import run_cli_metrics

    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    dev = [f"device={device}"] if device != "cpu" else []
    m = run_cli_metrics(run_dir, *BASE, f"trainer.steps={steps}", *dev, *overrides, timeout=timeout)
    prof, parts = m["profile"], m["ranks"][0]["time_ms"]
    step = prof.get("unprofiled_step_s") or m["step_time_s"]
    k = step / (parts["step"] / 1e3)  # the profiler's own cost, spread over the parts
    measured = {key: parts[key] / 1e3 * k for key in ("comm", "exposed_comm", "optimizer", "idle")}
    measured["compute"] = (parts["compute"] + parts["other"]) / 1e3 * k
    # every rank's traced compute: how far the ranks' speeds spread (_plantime_score's straggler fit)
    ranks = [(r["time_ms"]["compute"] + r["time_ms"]["other"]) / 1e3 * k for r in m["ranks"]]
    load = m["machine"]["start"]["loadavg"][0]
    # step_times_s: every step, warm-up and traced ones included, to see whether a run's level holds
    # or drifts within it (docs/plan.md, "The noise floor")
    return {
        "step_s": step,
        "parts": measured,
        "rank_compute": ranks,
        "loadavg_1m": load,
        "step_times_s": m["step_times_s"],
    }


def measure(names: dict[str, list[str]], args, workdir: Path, twice: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """``args.rounds`` interleaved rounds of every config in ``names``, the order rotated each round;
    the configs in ``twice`` (the calibration set) run a second time at the end of each round."""
    out: dict[str, list[dict]] = {name: [] for name in names}
    first = next(iter(names))
    run_once(names[first], args.steps, workdir, args.timeout, args.device)  # discarded: a cold machine
    for r in range(args.rounds):
        order = list(names)[r % len(names) :] + list(names)[: r % len(names)]  # rotate: no fixed slot
        for name in order + [n for n in order if n in twice]:
            steps = max(8, args.steps - 8) if "resnet18" in name else args.steps  # 0.4 s a step
            out[name].append(run_once(names[name], steps, workdir, args.timeout, args.device))
            print(f"round {r + 1}/{args.rounds} {name}: {out[name][-1]['step_s'] * 1e3:.1f} ms", file=sys.stderr)
            if args.out:  # what is measured so far survives a killed run (--replay reads it)
                args.out.with_suffix(".partial.json").write_text(json.dumps(out) + "\n")
    return out


def _held_out(args) -> dict[str, list[str]]:
    if args.calibrate_only:
        return {}
    if args.world1:
        return WORLD1
    return {n: HELD_OUT[n] for n in (QUICK if args.quick else HELD_OUT)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench plantime", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"held-out subset only: {', '.join(QUICK)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="per run: 4 warm-up, 2 traced, the rest timed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--calibrate-only", action="store_true", help="calibration set's world-1 rows only")
    parser.add_argument("--world1", action="store_true", help="world-1 rows only: calibration and world1_held_out")
    parser.add_argument("--calibration", type=Path, help="reuse this quick calibration (json) instead of measuring")
    parser.add_argument("--out", type=Path, help="write calibration, runs and predictions here (json)")
    parser.add_argument("--replay", type=Path, help="a saved --out: predict again from its calibration and runs")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a hung run is killed")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 8:
        parser.error(f"--rounds {args.rounds} must be >= 1, --steps {args.steps} >= 8 (4 warm-up, 2 traced, 2 timed)")
    from parallel_lab.plan.calibrate import Calibration, measure_calibration

    if args.replay:
        saved = json.loads(args.replay.read_text())
        if "runs" not in saved:  # a .partial.json of a killed run: its runs, and --calibration's file
            saved = {"runs": saved, "calibration": json.loads(args.calibration.read_text())}
        runs = saved["runs"]
        # the same runs under another quick calibration (also: one of an older calibration version)
        data = json.loads(args.calibration.read_text()) if args.calibration else saved["calibration"]
        calib = Calibration.upgraded(data)  # an older version's measurements: the fit below redoes the rest
        held = {n: ALL_HELD[n] for n in runs if n in ALL_HELD}
    else:
        load_before = os.getloadavg()
        calib = (
            Calibration.from_json(args.calibration.read_text())
            if args.calibration
            else measure_calibration(args.device)
        )
        one_rank = args.calibrate_only or args.world1
        cal_set = (
            {**{n: o for n, o in CALIBRATION.items() if "world_size=1" in o}, **WORLD1_CAL} if one_rank else CALIBRATION
        )
        held = _held_out(args)
        if args.out:  # the calibration first: a killed run can be replayed from it and its partial runs
            args.out.with_suffix(".calibration.json").write_text(calib.to_json() + "\n")
        with tempfile.TemporaryDirectory(prefix="bench_plantime_") as workdir:
            # twice per round on a CPU, whose level moves as a whole; a GPU machine's 16 cores do not
            # share with the run, and the --world1 rows must fit the 8 minutes there
            runs = measure({**cal_set, **held}, args, Path(workdir), twice=() if one_rank else tuple(cal_set))
        runs["_loadavg"] = [{"before": list(load_before), "after": list(os.getloadavg())}]
    fitted = score.fit(calib, {n: runs[n] for n in ALL_CAL if n in runs}, {**ALL_CAL, **ALL_HELD}, config_of)
    print(score.header(fitted, runs, args))
    rows = score.rows(fitted, {**ALL_CAL, **held}, runs, config_of)
    print(score.table(rows))
    held_rows = [r for r in rows if r["name"] in held]
    if held_rows:  # this run's validation, for the next run's interval (calibrate.DEFAULT_MODEL_ERROR_LOG)
        validated = score.model_error_log(held_rows)
        print("held-out log errors (q5, q50, q95), the next interval's model part:", *(f"{x:+.3f}" for x in validated))
    if args.out:
        payload = {"calibration": json.loads(calib.to_json()), "fitted": json.loads(fitted.to_json()), "runs": runs}
        if held_rows:
            payload["model_error_log"] = validated
        if args.calibrate_only:
            payload = json.loads(fitted.to_json())  # the calibration itself, for load_or_measure_calibration
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if held_rows:
        print(score.floor_line(rows))
        print(score.last_line(held_rows))
    return 0
