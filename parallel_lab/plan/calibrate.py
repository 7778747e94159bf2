"""The step-time model's calibration (``Calibration``): what this machine's operators, optimizer,
cores and collectives cost, measured in a few seconds without a training run, cached as json.

    load_or_measure_calibration()            # runs/calibration.json, measured (<= 8 s) if absent
    load_or_measure_calibration(device="cuda")  # the same on a GPU (nccl collectives with >= 2 GPUs)

What is measured (one thread, the run's device):

- ``ops``: per kind of operator (``parallel_lab.plan.census``: conv, matmul, pool, norm, memory) and dtype, one
  forward+backward of a conv / linear / ReLU at 3-4 sizes, fitted to ``calls x per_call_s + units x
  per_unit_s`` (units: FLOPs, or bytes read+written) by least squares in relative error;
- ``optimizer``: torch's Adam on one large and many small tensors: ``per_param_s``, ``per_tensor_s``;
  and what each tensor adds as a DTensor shard (FSDP2): ``dtensor_per_tensor_s``;
- ``bucketing``: a gradient hook's call and a bucket's hand-off to a communication thread
  (``hook_calibration.py``: manual_ddp's bucketed all-reduce);
- ``contention``: how much slower one process computes while a second computes too, measured with
  two real processes (shared caches, memory bandwidth, SMT siblings; 1.0 on a GPU);
- ``collectives``: gloo (and manual_ddp's hand-written ring and star) at world 2, 4 KiB-16 MiB, each op fitted
  to Hockney's ``alpha + bytes / beta`` (``steptime.fit_alpha_beta``); nccl on a GPU machine with two
  or more GPUs; none on one GPU;
- ``model_error_log``: the model's error on held-out configs as the last validation measured it
  (``DEFAULT_MODEL_ERROR_LOG``), the part of the interval no quick calibration can measure;
- ``scale``, ``interval_log`` and ``interval_low_log``: the last fit's figures (``DEFAULT_SCALE``)
  until ``python -m parallel_lab.bench plantime`` fits them on its calibration set (a few real runs)
  and writes them back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from parallel_lab.plan.census import Census
from parallel_lab.plan.comm_calibration import STAR_OP
from parallel_lab.plan.hook_calibration import measure_bucketing
from parallel_lab.plan.microbench import contention_probe, on_gpu, pass_timer
from parallel_lab.plan.optimizer_calibration import adam_step, dtensor_or_none
from parallel_lab.threads import torch_threads

DEFAULT_PATH = Path("runs/calibration.json")
# 2: the pool and norm kinds (a version-1 file lacks them and is measured again); 3: the wrappers'
# per-unit and per-DTensor costs (scale unit_s, dtensor_s) and the interval's two sides; 4: DTensor's
# per-tensor optimizer cost measured (optimizer["dtensor_per_tensor_s"]), its per-step part fitted;
# 5: manual_ddp's bucketing costs (``bucketing``: a gradient hook's call, a bucket's hand-off); 6:
# manual_ddp's star all-reduce timed beside its ring (``collectives["hand"]["all_reduce_star"]``).
VERSION = 6
# Until bench plantime's calibration set refits them here: what it fitted on the 2-core machine of
# docs/plan.md (the 06:11 UTC run of 2026-11-27, the first with the null pass and the runs' own
# Adam in the micro-benchmarks). The interval: high = point x exp(DEFAULT_INTERVAL_LOG),
# low = point x exp(-DEFAULT_INTERVAL_LOW_LOG), that run's (``_plantime_score.interval_of``).
DEFAULT_INTERVAL_LOG = 0.27
DEFAULT_INTERVAL_LOW_LOG = 0.22
# The model's error on configs it was never fitted on: the held-out rows' log errors (measured
# median step over predicted), 5th / 50th / 95th percentile, pooled over the thirteen validation
# runs of docs/plan.md replayed on this model (182 rows). ``bench plantime`` combines it with the
# noise it measures (``interval_of``) and prints this run's, for the next.
DEFAULT_MODEL_ERROR_LOG = (-0.16, 0.03, 0.20)
# The corrections: compute, bf16 and Adam multipliers on the micro-benchmarks' lines, the loop's
# seconds per pass beyond them (loop_s: fitted where the set has two models' one-rank rows), each
# collective family's multiplier on its alpha-beta time ("comm": families no calibration row used),
# the share of overlapped communication found hidden, a wrapper's seconds per hooked unit and pass
# (unit_s) and per step of an optimizer over DTensors beyond their measured per-tensor dispatch
# (dtensor_step_s: ``measure_dtensor_optimizer``), the ranks' relative speed spread behind
# the wait for the slowest (straggle: ``steptime.straggler_wait``).
# DTensor's optimizer cost per tensor for replaying a CPU calibration measured before version 4:
# 0.106 (cnn) and 0.113 ms (vit), Adam around fully_shard at world 1 on the 2-core CPU (docs/gpu.md).
REPLAY_DTENSOR_PER_TENSOR_S = 0.00011
# Bucketing's costs for replaying a calibration measured before version 5: the median of five
# ``hook_calibration.measure_bucketing`` on the 2-core CPU (0.82-0.98 and 18.6-24.4 us), load 3-8.
REPLAY_BUCKETING = {"grad_hook_s": 0.9e-6, "handoff_s": 20e-6}
DEFAULT_SCALE = {
    "compute": 1.08,
    "loop_s": 0.0,
    "bf16": 0.93,
    "optimizer": 1.97,
    "comm": 3.22,
    "comm_all_reduce": 2.94,
    "comm_all_gather": 3.25,
    "comm_reduce_scatter": 3.25,
    "hidden": 0.0,
    "unit_s": 0.0025,
    "dtensor_step_s": 0.0,
    "straggle": 0.063,
}


@dataclass
class Calibration:
    """Everything ``steptime.predict_step`` needs of the machine (json round-trip: to_json/from_json)."""

    device: str = "cpu"
    cpu_count: int = 1
    loadavg_1m: float = 0.0  # when measured
    ops: dict[str, dict[str, float]] = field(default_factory=dict)  # "<kind>@<dtype>" -> per_call_s, per_unit_s
    pass_s: float = 0.0  # a forward+backward pass's own cost, whatever it computes (calibrate.NULL_PASS)
    bench_s: dict[str, float] = field(default_factory=dict)  # every micro-benchmark's fastest seconds
    optimizer: dict[str, float] = field(default_factory=dict)  # per_param_s, per_tensor_s, dtensor_per_tensor_s
    contention: float = 1.0  # one process's slowdown while another computes beside it (>= 1)
    bucketing: dict[str, float] = field(default_factory=dict)  # grad_hook_s, handoff_s (hook_calibration.py)
    collectives: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # impl -> op -> alpha_s, beta_Bps
    comm_world: int = 2  # the world size the collectives were measured at
    scale: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SCALE))
    interval_log: float = DEFAULT_INTERVAL_LOG  # the interval's upper side (log of high / point)
    interval_low_log: float = DEFAULT_INTERVAL_LOW_LOG  # its lower side (log of point / low)
    # held-out configs' log errors (q5, q50, q95), as the last validation measured them
    model_error_log: list[float] = field(default_factory=lambda: list(DEFAULT_MODEL_ERROR_LOG))
    measured_s: float = 0.0
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        if data.get("version") != VERSION:
            raise ValueError(f"calibration version {data.get('version')} is not {VERSION}; measure it again")
        return cls(**data)

    @classmethod
    def upgraded(cls, data: dict) -> "Calibration":
        """An older version's measurements (same ops and collectives) with this version's defaults for
        what the bench refits anyway (scale, interval): ``bench plantime --replay`` of older runs."""
        if not {"pool@fp32", "norm@fp32"} <= set(data.get("ops", {})):
            raise ValueError("calibration lacks the pool and norm kinds (version 1); measure it again")
        known = {f.name for f in dataclasses.fields(cls)} - {"scale", "version"}
        calib = cls(**{k: v for k, v in data.items() if k in known})
        if calib.device == "cpu":  # before version 4: as measured alone on the 2-core CPU (docs/gpu.md)
            calib.optimizer.setdefault("dtensor_per_tensor_s", REPLAY_DTENSOR_PER_TENSOR_S)
            calib.bucketing = calib.bucketing or dict(REPLAY_BUCKETING)  # before version 5
        hand, send = calib.collectives.get("hand"), calib.collectives.get("gloo", {}).get("broadcast")
        if hand is not None and send is not None:  # before version 6: the star from gloo's send
            hand.setdefault(STAR_OP, replay_star(send))
        return calib


def replay_star(send: dict[str, float]) -> dict[str, float]:
    """manual_ddp's star all-reduce at world 2 for a calibration that did not time it (before
    version 6): gloo's one send of the tensor (its broadcast at world 2) twice in a row, rank 1's
    tensor to rank 0 and the sum back; the add between them (a memory pass) is left out."""
    return {"alpha_s": 2 * send["alpha_s"], "beta_Bps": send["beta_Bps"] / 2}


def load_or_measure_calibration(
    path: Path | None = None, device: str | None = None, dtypes: tuple[str, ...] | None = None
) -> Calibration:
    """The calibration cached at ``path`` (default ``runs/calibration.json``, under the current
    directory) where it holds every one of ``dtypes``' operator lines (None: every dtype), else a quick one of those
    dtypes measured now (<= 8 s, no training run) and written there. A caller that predicts fp32
    only asks for fp32 (the recommender of an fp32 run: this machine's bf16 matmuls took half of a
    cold calibration); the next caller that needs bf16 measures again."""
    path = Path(path) if path is not None else DEFAULT_PATH
    dtypes = tuple(DTYPES) if dtypes is None else dtypes  # every dtype by default
    if path.exists():
        try:
            cached = Calibration.from_json(path.read_text())
            if set(dtypes) <= measured_dtypes(cached):
                return cached
        except (ValueError, TypeError, json.JSONDecodeError):
            pass  # a stale or damaged file: measure again and overwrite it
    calib = measure_calibration(device or ("cuda" if torch.cuda.is_available() else "cpu"), dtypes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(calib.to_json() + "\n")
    tmp.replace(path)  # never half-written
    return calib


def measured_dtypes(calib: Calibration) -> set[str]:
    """The dtypes whose operator lines ``calib`` holds ("fp32", "bf16")."""
    return {key.partition("@")[2] for key in calib.ops}


# ---- fits --------------------------------------------------------------------------------------------
def fit_per_call(points: list[tuple[float, ...]]) -> dict[str, float]:
    """Least squares of ``t = calls x per_call + units x per_unit [+ thin x per_thin]`` over
    (calls, units, [thin,] t) points, in relative error; a negative coefficient is dropped (0) and
    the rest refitted, so every term costs time or nothing."""
    names = ("per_call_s", "per_unit_s", "per_thin_s")[: len(points[0]) - 1]
    active = list(range(len(names)))
    while True:
        a = torch.tensor([[p[i] / p[-1] for i in active] for p in points], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, torch.ones(len(points), 1, dtype=torch.float64)).solution.flatten().tolist()
        if min(coef) >= 0 or len(active) == 1:
            out = dict.fromkeys(names, 0.0)
            out.update({names[i]: max(0.0, c) for i, c in zip(active, coef)})
            return out
        active.pop(coef.index(min(coef)))


def kind_seconds(calib: Calibration, census: Census, dtype: str) -> dict[str, float]:
    """Seconds per kind of one pass: each kind's calls and units through its fitted line (conv and
    matmul in the pass's dtype; memory traffic is bytes whatever the dtype)."""
    out = {}
    for kind, calls in census.calls.items():
        fit = calib.ops.get(f"{kind}@{dtype}") or calib.ops[f"{kind}@fp32"]
        out[kind] = (
            calls * fit["per_call_s"]
            + census.units[kind] * fit["per_unit_s"]
            + census.thin[kind] * fit.get("per_thin_s", 0.0)
        )
    return out


# ---- micro-benchmarks --------------------------------------------------------------------------------
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (kind, module factory, input shape): sizes spanning these models' layers (cnn, resnet18 on
# 32x32 CIFAR, vit's token x width matmuls).
BENCHES = {
    "memory": [(lambda: torch.nn.ReLU(), (n,)) for n in (1 << 16, 1 << 19, 1 << 22)],
    "pool": [(lambda: torch.nn.MaxPool2d(2), (4, c, hw, hw)) for c, hw in ((16, 32), (64, 16), (256, 8))],
    "norm": [(lambda: torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.GELU(), torch.nn.Softmax(-1)), (n, 256))
             for n in (128, 1024, 4096)],
    "conv": [(lambda i=i, o=o: torch.nn.Conv2d(i, o, 3, padding=1), (4, i, hw, hw))
             for i, o, hw in ((3, 32, 32), (16, 16, 32), (32, 64, 16), (128, 128, 8), (256, 256, 4))],
    "matmul": [(lambda i=i, o=o: torch.nn.Linear(i, o), (n, i))
               for n, i, o in ((1024, 32, 256), (256, 128, 128), (512, 512, 512), (256, 1024, 1024))],
}  # fmt: skip


def _bench_census(factory, shape: tuple, dtype: torch.dtype) -> Census:
    """The census of a micro-benchmark's pass (the same counting the models get)."""
    from parallel_lab.plan.census import _Counter

    module = factory().to(device="meta", dtype=dtype)
    x = torch.empty(shape, device="meta", dtype=dtype, requires_grad=True)
    counter = _Counter()
    with counter:
        module(x).sum().backward()
    return counter.census


# Rounds over every micro-benchmark, each point's fastest kept. Timed kind after kind in one pass,
# a fresh process's first benchmarks ran cold and a passing slowdown fell on one kind only: the
# matmul line's per-call cost came out 1-182 us over twelve saved calibrations, and ddp vit (all
# matmuls, anchored on the cnn's convs) was predicted +54% at 02:52 (docs/plan.md). Interleaved,
# every kind sees the same machine. Each benchmark is built and warmed up once, in the first round
# (``microbench.pass_timer``): a warm-up in every round was a sixth of the passes and timed nothing.
OPS_ROUNDS = 3


# On a GPU every one of those sizes is launch-bound: on the H100 no per-FLOP term survived the fit,
# and the cnn at batch 256 was predicted at 3x its measured step (docs/gpu.md). There each
# benchmark also runs at GPU_BATCH times its batch, where the kernels, not their launches, take the
# time, so the line has both ends.
GPU_BATCH = 32


def benches_for(device: str) -> dict[str, list[tuple]]:
    """The micro-benchmarks a device runs: ``BENCHES``, and on a GPU each at ``GPU_BATCH`` x its batch too."""
    if not on_gpu(device):
        return BENCHES
    return {kind: [*b, *((f, (s[0] * GPU_BATCH, *s[1:])) for f, s in b)] for kind, b in BENCHES.items()}


# A pass of nothing (one element's sum and its backward): what every pass pays once whatever it
# computes (autograd's engine starting, the sum, the gradient's fill), timed with the rest and
# taken off each benchmark before the lines are fitted, so that a kind with one call per pass is
# not charged it per call; the model charges it once per pass (``Calibration.pass_s``).
NULL_PASS = (lambda: torch.nn.Identity(), (1,))


def _timed(device: str) -> dict[str, list[tuple]]:
    return {"pass": [NULL_PASS], **benches_for(device)}


def bench_censuses(device: str = "cpu", dtypes: tuple[str, ...] = tuple(DTYPES)) -> dict[tuple[str, str, int], Census]:
    """Every micro-benchmark's census, by (dtype, kind, index): counted on the meta device, untimed."""
    benches = _timed(device)
    return {
        (d, kind, i): _bench_census(factory, shape, DTYPES[d])
        for d in dtypes
        for kind in benches
        for i, (factory, shape) in enumerate(benches[kind])
    }


def measure_ops(
    device: str, rounds: int = OPS_ROUNDS, censuses: dict | None = None, dtypes: tuple[str, ...] = tuple(DTYPES)
) -> tuple[dict, float, dict]:
    """Every kind's line, per dtype of ``dtypes``, from ``rounds`` interleaved rounds over all the
    benchmarks; the null pass's seconds; every benchmark's fastest seconds ("<dtype> <kind> <index>":
    what ``fit_ops`` can start again from)."""
    censuses = censuses or bench_censuses(device, dtypes)
    table = _timed(device)
    benches = [(d, kind, i) for d in dtypes for kind in table for i in range(len(table[kind]))]
    fastest = dict.fromkeys(benches, float("inf"))
    timers: dict = {}  # built (and warmed up) in the first round, in its order: every later round reuses them
    for _ in range(rounds):
        for d, kind, i in benches:
            if (d, kind, i) not in timers:
                factory, shape = table[kind][i]
                timers[d, kind, i] = pass_timer(factory(), shape, DTYPES[d], device)
            fastest[d, kind, i] = min(fastest[d, kind, i], timers[d, kind, i]())
    raw = {f"{d} {kind} {i}": t for (d, kind, i), t in fastest.items()}
    return fit_ops(raw, censuses), raw["fp32 pass 0"], raw


def fit_ops(raw: dict[str, float], censuses: dict, null_pass: bool = True) -> dict[str, dict[str, float]]:
    """Every kind's line from the benchmarks' fastest seconds (``Calibration.bench_s``), each less
    the null pass (``null_pass=False``: as fitted before it was measured) and the memory line's
    share (the bench's own sum and its backward)."""
    ops: dict[str, dict[str, float]] = {}
    for d in (d for d in DTYPES if f"{d} pass 0" in raw):  # the dtypes measured
        null = censuses[d, "pass", 0]
        null_s, less = (raw[f"{d} pass 0"], null.calls) if null_pass else (0.0, dict.fromkeys(null.calls, 0))
        kinds = sorted({k for (dd, k, _) in censuses if dd == d} - {"pass", "memory"})
        for kind in ("memory", *kinds):  # memory first: the others subtract it
            points = []
            for i in range(sum(1 for key in censuses if key[:2] == (d, kind))):
                census, t = censuses[d, kind, i], raw[f"{d} {kind} {i}"]
                t = max(0.05 * t, t - null_s)
                if kind != "memory":
                    mem = ops[f"memory@{d}"]
                    calls = census.calls["memory"] - less["memory"]
                    t = max(t * 0.05, t - calls * mem["per_call_s"] - census.units["memory"] * mem["per_unit_s"])
                thin = (census.thin[kind],) if kind in ("conv", "matmul") else ()
                # at least one call: ReLU's census counts as many memory calls as the null pass's
                points.append((max(1, census.calls[kind] - less[kind]), census.units[kind], *thin, t))
            ops[f"{kind}@{d}"] = fit_per_call(points)
    return ops


def measure_optimizer(device: str) -> dict[str, float]:
    """The runs' optimizer (``optim.optimizer_factory`` with the trainer's defaults: Adam, one tensor
    at a time) on one 1M-element tensor and on 200 tensors of 1K: the fastest of 3 steps after the
    first (which creates the state), fitted per tensor and per parameter.

    Not torch's default foreach Adam: on the H100 that cost 8 us per tensor, the runs' per-tensor
    Adam ~80 (the cnn's 10 tensors 1.0 ms, the vit's 71 5.7 ms), and the one-rank row's scale (x7.6)
    then priced resnet18's 11M parameters at 3x their time (docs/gpu.md). On a CPU the two cost alike."""
    points = []
    for shapes in ([(1 << 20,)], [(1024,)] * 200):
        step = adam_step([torch.zeros(s, device=device) for s in shapes], device)
        times = [step() for _ in range(4)]
        points.append((len(shapes), sum(math.prod(s) for s in shapes), min(times[1:])))
    fit = fit_per_call(points)
    return {"per_tensor_s": fit["per_call_s"], "per_param_s": fit["per_unit_s"]}


def measure_calibration(device: str = "cpu", dtypes: tuple[str, ...] = tuple(DTYPES)) -> Calibration:
    """A quick calibration of this machine (<= 8 s on 2 CPU cores; no training run): the operator
    lines of ``dtypes`` (fp32 always: the memory line and the null pass are fitted from it)."""
    dtypes = tuple(d for d in DTYPES if d in dtypes or d == "fp32")
    from parallel_lab.plan.comm_calibration import finish_pairs, start_pairs, stop_pairs, wait_ready

    start = time.perf_counter()
    # The two processes start first (on a CPU forks of this one, before DTensor or the compiler are
    # imported here; elsewhere fresh interpreters, whose imports overlap the untimed operator counts);
    # nothing is timed until both wait idle.
    with torch_threads(1):
        procs = start_pairs(device)
        try:
            censuses = bench_censuses(device, dtypes)
            dtensor_or_none(device, reps=1)  # untimed: DTensor's first use imports and registers ~1.4 s of code
            wait_ready(procs)
            ops, pass_s, bench_s = measure_ops(device, censuses=censuses, dtypes=dtypes)
            optimizer = measure_optimizer(device)
            optimizer["dtensor_per_tensor_s"] = dtensor_or_none(device)
            bucketing = measure_bucketing()
            solo = contention_probe(device)  # alone, before the two processes compute
        except BaseException:
            stop_pairs(procs)
            raise
    pair = finish_pairs(procs, solo, device)
    return Calibration(
        device=device,
        cpu_count=os.cpu_count() or 1,
        loadavg_1m=os.getloadavg()[0],
        ops=ops,
        pass_s=pass_s,
        bench_s=bench_s,
        optimizer=optimizer,
        contention=pair["contention"],
        bucketing=bucketing,
        collectives=pair["collectives"],
        measured_s=time.perf_counter() - start,
    )
