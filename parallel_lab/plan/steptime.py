"""Step time, predicted per part as the profiler measures it (compute, comm, exposed_comm,
optimizer, idle; ``worker/timeline.py``), under the run's own conditions, with an interval.

    calib = load_or_measure_calibration()          # runs/calibration.json, or measured (seconds)
    pred = predict_step(cfg, strategy_cls, meta_model, calib)
    pred.point_s, pred.low_s, pred.high_s, pred.parts   # rank 0's step, seconds

* Compute, per operator (``plan/census.py``): every aten operator of one forward + loss +
  backward, counted on the meta device, each kind (conv, matmul, pool, norm/softmax/GELU, other
  memory traffic) through the line its micro-benchmarks fitted (``plan/calibrate.py``: per call +
  per FLOP or byte + per FLOP over the smallest GEMM dimension); nothing is measured per model, so
  resnet18 and vit are predicted without ever being calibrated on. A rank runs
  ``PlanRules.compute_shape``'s slots x flop share of such passes (pipeline: the idle slots are
  ``idle``).
* Wrappers: ``ComputeShape.hooked_units`` (FSDP's units, ZeRO-3's modules) cost ``unit_s`` each
  per pass (their hooks' Python, copies and DTensor dispatch), fitted on the calibration set; an
  optimizer over DTensor shards (``dtensor_optimizer``: FSDP2) costs DTensor's dispatch per tensor,
  measured (``optimizer["dtensor_per_tensor_s"]``), and ``dtensor_step_s`` per step, fitted.
* Cores: ranks x threads (+ a background load) over ``os.cpu_count()``: each busy rank gets its
  share of a core (time-slicing), never less slowdown than the contention two computing processes
  were measured to cause each other. Data-parallel ranks compute in lockstep (each step ends in
  the same collectives), so all of them want a core at once and none lends its core while it
  waits in a collective: only a pipeline stage idling in a bubble yields its core to a computing
  stage (a fixed point on the non-idle share of the step). The collectives themselves take their
  two-rank time scaled by the ring (no extra for ranks outnumbering cores: measured at world 3
  and 4 on 2 cores, docs/plan.md).
* Bucketing written by hand (manual_ddp bucketed): each pass's gradient hooks and each step's buckets
  handed to the communication thread, at the calibration's measured cost per call
  (``bucketing_seconds``; ``plan/hook_calibration.py``).
* Optimizer: torch's Adam per parameter and per tensor, on the parameters this rank updates.
* Communication: ``PlanRules.predict_comm``'s bytes per collective through Hockney's alpha-beta
  fitted at world 2 (R. W. Hockney, "The communication challenge for MPP", Parallel Computing
  20(3), 1994), scaled to world N by the ring's steps and payload share, with the real number of
  calls (DDP's buckets, FSDP's units, ZeRO's buckets, pipeline micro-batches:
  ``PlanRules.collective_calls`` and the bucket options); manual_ddp's star all-reduce through its
  own fit, scaled by rank 0's messages and bytes (``star_factors``), never as the ring; exposed:
  the collectives issued outside backward plus what the calibration found not hidden of those
  issued during it (``PlanRules.overlapped_collectives``).
* Corrections and interval: ``python -m parallel_lab.bench plantime`` fits a scale per part on a
  small calibration set of real runs and the interval's two sides from its signed residuals
  (``[point x exp(-interval_low_log), point x exp(interval_log)]``: a load only slows a run;
  docs/plan.md); a quick calibration carries the last fit's figures (``calibrate.DEFAULT_SCALE``).

Nothing here is a GPU time unless the calibration was measured on a GPU (``device="cuda"``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from parallel_lab.plan.alphabeta import AlphaBeta, fit_alpha_beta  # noqa: F401  (re-exported)
from parallel_lab.plan.calibrate import Calibration, load_or_measure_calibration  # noqa: F401  (re-exported)
from parallel_lab.plan.comm_calibration import STAR_OP

# The counter's op names (comm/counter.py) -> (the collectives bench's op, counted bytes per payload
# byte). The counter counts an all-reduce of B bytes as 2B; the bench's size S is the tensor for
# all_reduce and broadcast, the output of all_gather and the input of reduce_scatter, which is what
# the counter counts for those. A point-to-point send at world 2 is timed as a broadcast (one send).
COUNTED_AS: dict[str, tuple[str, float]] = {
    "all_reduce": ("all_reduce", 2.0),
    "all_gather_single": ("all_gather", 1.0),
    "all_gather_into_tensor": ("all_gather", 1.0),
    "_all_gather_base": ("all_gather", 1.0),
    "reduce_scatter_single": ("reduce_scatter", 1.0),
    "reduce_scatter_tensor": ("reduce_scatter", 1.0),
    "_reduce_scatter_base": ("reduce_scatter", 1.0),
    "broadcast": ("broadcast", 1.0),
    "isend": ("broadcast", 1.0),
    "send": ("broadcast", 1.0),
}

BACKWARD_SHARE = 2 / 3  # backward is ~2x forward's FLOPs (a conv/linear's two gradients)


# How a collective's cost grows with the world on a ring (Thakur, Rabenseifner & Gropp, "Optimization
# of collective communication operations in MPICH", IJHPCA 19(1), 2005): (latency steps, fraction of
# the payload each rank moves). Broadcast: a binomial tree. Fitted at world 2, scaled by the ratio.
def ring_factors(op: str, world: int) -> tuple[float, float]:
    if world < 2:
        return 0.0, 0.0
    if op == "all_reduce":
        return 2.0 * (world - 1), 2.0 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return float(world - 1), (world - 1) / world
    rounds = float(math.ceil(math.log2(world)))
    return rounds, rounds  # broadcast: each round one whole payload


def star_factors(world: int) -> tuple[float, float]:
    """(messages, payloads) through rank 0 of the star all-reduce (``comm/collectives.py``
    ``_star_all_reduce``): it receives the other ``world - 1`` tensors, adds them, and sends the sum
    to each, so ``2(w-1)`` messages and ``2(w-1)`` payloads pass through it (each other rank: 2
    and 2), and the step waits for rank 0. Fitted at world 2 (2 and 2), so the star's time grows as
    ``w - 1`` where the ring's bytes per rank stay under ``2`` (Thakur, Rabenseifner & Gropp 2005)."""
    if world < 2:
        return 0.0, 0.0
    return 2.0 * (world - 1), 2.0 * (world - 1)


def collective_seconds(
    fit: AlphaBeta, op: str, payload: float, calls: int, world: int, fit_world: int = 2
) -> tuple[float, float]:
    """(latency s, bandwidth s) of ``calls`` calls moving ``payload`` bytes in all (the bench's size:
    see COUNTED_AS) at ``world`` ranks, from a fit measured at ``fit_world``; a point-to-point send
    (``p2p``) does not scale with the world; the star all-reduce (``STAR_OP``) scales as its rank 0."""
    if op == "p2p":
        return calls * fit.alpha_s, payload / fit.beta_Bps
    factors = star_factors if op == STAR_OP else functools.partial(ring_factors, op)
    steps, share = factors(world)
    steps2, share2 = factors(fit_world)
    return calls * fit.alpha_s * steps / steps2, payload / fit.beta_Bps * share / share2


def algorithm_op(cfg, bench_op: str, fits: dict) -> str:
    """The calibration's op that prices ``bench_op`` under this config: manual_ddp's star
    all-reduce has its own line where the calibration timed it (``STAR_OP``, version 6); every
    other all-reduce, and the star under a calibration without it (a GPU's: nccl only), the op's."""
    algorithm = str(getattr(cfg.strategy.get("allreduce"), "value", cfg.strategy.get("allreduce")))
    return STAR_OP if bench_op == "all_reduce" and algorithm == "star" and STAR_OP in fits else bench_op


@dataclass
class StepPrediction:
    """One config's predicted step on rank 0 (the rank metrics.json's step_time_s times), in seconds:
    ``parts`` has the profiler's keys (compute, comm, exposed_comm, optimizer, idle; comm overlaps
    the others, the rest add up to ``point_s``), ``[low_s, high_s]`` the prediction interval."""

    strategy: str
    point_s: float
    low_s: float
    high_s: float
    parts: dict[str, float]
    comm_by_op: dict[str, float] = field(default_factory=dict)
    comm_raw: dict[str, float] = field(default_factory=dict)  # s per bench op before the comm scales
    notes: list[str] = field(default_factory=list)


def _dtype(cfg) -> str:
    keys = (cfg.trainer.get("precision"), cfg.strategy.get("precision"), cfg.strategy.get("mixed_precision"))
    return "bf16" if any(str(getattr(k, "value", k)) == "bf16" for k in keys) else "fp32"


def _threads(cfg) -> int:
    """The intra-op threads one rank runs with (trainer.threads; 1 when unset)."""
    return cfg.trainer.get("threads") or cfg.trainer.get("threads_per_rank") or 1


def _cores(
    cfg, strategy_cls: type, calib: Calibration, background_load: float, busy: float = 1.0
) -> tuple[float, float, int]:
    """(timeslice, contention, threads): how much slower each rank's operators run because the
    busy ranks x threads (+ the background load) outnumber the cores, how much the ranks slow each
    other even with a core each (calibrated), and the intra-op threads that share a rank's FLOPs."""
    if calib.device == "cuda":
        return 1.0, 1.0, 1
    procs = 1 if strategy_cls.plan.single_process else cfg.world_size
    threads = _threads(cfg)
    demand = procs * threads * busy + max(0.0, background_load)
    timeslice = max(1.0, demand / calib.cpu_count)
    return timeslice, calib.contention if procs * threads > 1 else 1.0, threads


def _calls(cfg, strategy_cls: type, model: nn.Module, op: str, payload: float, shape) -> int:
    """Calls of one collective per step: the strategy's own count (DDP's and manual_ddp's buckets),
    else the pipeline's per micro-batch, else one per bucket of ``bucket_mb`` (ZeRO), else one."""
    fixed = strategy_cls.plan.collective_calls(cfg, model)
    if op in fixed:
        return fixed[op]
    if shape.calls_per_collective:
        return shape.calls_per_collective
    opts = cfg.strategy
    if opts.get("bucketed") is False:
        return 1
    if opts.get("bucket_mb"):
        return max(1, math.ceil(payload / (opts.bucket_mb * 2**20)))
    return 1


def predict_comm_seconds(
    cfg, strategy_cls: type, model: nn.Module, calib: Calibration, shape
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per collective (the counter's names), and the unscaled seconds per bench op that the
    calibration set fits its scales ``comm_<op>`` on: in training a collective also waits for the
    slower rank and copies into and out of the strategy's buffers, which the two-process benchmark
    does not see; each family (DDP's all-reduce, FSDP's all-gather and reduce-scatter) its own."""
    fits = calib.collectives.get(strategy_cls.plan.comm_impl(cfg)) or next(iter(calib.collectives.values()), None)
    out: dict[str, float] = {}
    raw: dict[str, float] = {}
    for op, counted in (strategy_cls.plan.predict_comm(cfg, model, 0) or {}).items():
        if not counted or fits is None:
            continue
        bench_op, per_payload = COUNTED_AS[op]
        payload = counted / per_payload
        kind = "p2p" if op in ("isend", "send") else algorithm_op(cfg, bench_op, fits)
        calls = _calls(cfg, strategy_cls, model, op, payload, shape)
        fit = AlphaBeta(**fits[kind if kind != "p2p" else bench_op])
        seconds = sum(collective_seconds(fit, kind, payload, calls, cfg.world_size, calib.comm_world))
        raw[bench_op] = raw.get(bench_op, 0.0) + seconds
        out[op] = seconds * calib.scale.get(f"comm_{bench_op}", calib.scale.get("comm", 1.0))
    return out, raw


def predict_step(
    cfg, strategy_cls: type, model: nn.Module, calib: Calibration, *, background_load: float = 0.0
) -> StepPrediction:
    """Rank 0's step for a validated config: the census of one pass (``plan/census.py``) through
    the calibrated per-operator lines, slowed by the cores the run's ranks x threads share,
    ``slots`` passes of ``flop_share`` of the model (``PlanRules.compute_shape``), the idle slots of a
    pipeline; Adam on the parameters this rank updates; collectives from ``predict_comm`` through
    alpha-beta at world 2 scaled to the world by ring formulas, with the calls per step; exposed
    communication: the non-overlapped collectives plus the part of the overlapped ones
    (``PlanRules.overlapped_collectives``) that calibration did not find hidden behind backward.
    ``background_load``: other runnable processes on the machine (e.g. the load average).

    More ranks than cores: a pipeline stage idling in a bubble yields its core, so the ranks'
    demand is their count x the non-idle share of their step, found by a few fixed-point rounds
    from "always busy" (data-parallel ranks compute in lockstep: always busy)."""
    from parallel_lab.plan.census import census_of

    shape = strategy_cls.plan.compute_shape(cfg, model)
    dtype = _dtype(cfg)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    census = census_of(model, shape.micro_batch, torch_dtype, cfg.trainer.get("recompute", "none"))
    comm_by_op, comm_raw = predict_comm_seconds(cfg, strategy_cls, model, calib, shape)
    busy = 1.0
    optimizer = _optimizer_seconds(cfg, strategy_cls, model, calib, shape)  # the same in every round
    for _ in range(4):
        timeslice, contention, threads = _cores(cfg, strategy_cls, calib, background_load, busy)
        parts = _step_parts(cfg, strategy_cls, calib, shape, census, dtype, (timeslice, contention, threads), optimizer)
        parts.update(_exposed(cfg, strategy_cls, comm_by_op, parts, calib, bucketing_seconds(shape, calib)[1]))
        point = sum(parts[k] for k in ("compute", "idle", "optimizer", "exposed_comm"))
        busy = 1.0 - parts["idle"] / point
    notes = [shape.note] if shape.note else []
    low, high = point * math.exp(-calib.interval_low_log), point * math.exp(calib.interval_log)
    return StepPrediction(cfg.strategy.name, point, low, high, parts, comm_by_op, comm_raw, notes)


def _step_parts(cfg, strategy_cls: type, calib: Calibration, shape, census, dtype: str, cores, optimizer: float):
    """compute, idle and optimizer seconds under (timeslice, contention, threads); ``optimizer``:
    the step's optimizer seconds on a core of its own (``_optimizer_seconds``)."""
    from parallel_lab.plan.calibrate import kind_seconds

    timeslice, contention, threads = cores
    per_kind = kind_seconds(calib, census, dtype)
    per_call = sum(
        census.calls[k] * (calib.ops.get(f"{k}@{dtype}") or calib.ops[f"{k}@fp32"])["per_call_s"] for k in per_kind
    )
    units = sum(per_kind.values()) - per_call
    # Ranks time-sliced on shared cores already pay for sharing them: the larger of the two.
    one_pass = (per_call + calib.pass_s) * timeslice + units * max(timeslice, contention) / threads
    scale = calib.scale.get("compute", 1.0) * (calib.scale.get("bf16", 1.0) if dtype == "bf16" else 1.0)
    # A wrapper's hooks (Python, copies, DTensor dispatch) cost per unit and pass, not per FLOP.
    hooks = shape.hooked_units * calib.scale.get("unit_s", 0.0) * timeslice
    # The loop's own cost per pass (the loss, the batch's copy, Python between launches), whatever
    # the pass computes: fitted only where the calibration set has rows of two models (a GPU's).
    loop = calib.scale.get("loop_s", 0.0) * timeslice
    grad_hooks, _ = bucketing_seconds(shape, calib)
    fwd_bwd = shape.slots * (shape.flop_share * one_pass * scale + hooks + loop + grad_hooks * timeslice)
    dp = strategy_cls.plan.data_parallel_size(cfg)
    passes = cfg.trainer.global_batch // (dp * shape.micro_batch) * cfg.strategy.get("virtual_stages", 1)
    idle = fwd_bwd * max(0, shape.slots - passes) / shape.slots
    return {"compute": fwd_bwd - idle, "idle": idle, "optimizer": optimizer * max(timeslice, contention)}


def _optimizer_seconds(cfg, strategy_cls: type, model: nn.Module, calib: Calibration, shape) -> float:
    """Rank 0's optimizer step on a core of its own: Adam's calibrated line on the parameters and
    tensors it updates, and DTensor's dispatch per tensor where the optimizer steps DTensors."""
    params, tensors = _optimizer_params(cfg, strategy_cls, model, 0)
    opt = calib.optimizer
    optimizer = (params * opt["per_param_s"] + tensors * opt["per_tensor_s"]) * calib.scale.get("optimizer", 1.0)
    if shape.dtensor_optimizer:  # every DTensor's update goes through DTensor's dispatch, and the step
        dispatch = opt.get("dtensor_per_tensor_s", 0.0)  # has a part of its own (docs/gpu.md)
        optimizer += len(list(model.parameters())) * dispatch + calib.scale.get("dtensor_step_s", 0.0)
    return optimizer


def _exposed(
    cfg, strategy_cls: type, comm_by_op: dict[str, float], parts: dict, calib: Calibration, handoff: float = 0.0
) -> dict:
    """comm, and what of it rank 0 waits out: the collectives not hidden behind backward, plus the
    wait for the slowest rank (``straggler_wait``) and the buckets' hand-offs to a communication
    thread (``bucketing_seconds``: the training thread waits on each)."""
    comm = sum(comm_by_op.values())
    overlapped = sum(s for op, s in comm_by_op.items() if op in strategy_cls.plan.overlapped_collectives(cfg))
    hidden = min(overlapped * calib.scale.get("hidden", 0.5), BACKWARD_SHARE * parts["compute"])
    wait = straggler_wait(cfg, strategy_cls, calib, parts) + handoff
    return {"comm": comm + wait, "exposed_comm": comm - hidden + wait}


def bucketing_seconds(shape, calib: Calibration) -> tuple[float, float]:
    """(per pass, per step) seconds a strategy's own bucketing costs beyond one all-reduce after
    backward: its gradient hooks (``shape.grad_hooks`` calls a pass) and its buckets' hand-offs to
    the communication thread and waits (``shape.handoffs`` a step), each at the calibration's
    measured cost (``Calibration.bucketing``; plan/hook_calibration.py). What bucketing can gain,
    all-reduces under backward, is the ``hidden`` share of the overlapped collectives
    (``_exposed``); with one bucket, ready only when backward ends, it gains nothing and pays these."""
    costs = calib.bucketing
    return shape.grad_hooks * costs.get("grad_hook_s", 0.0), shape.handoffs * costs.get("handoff_s", 0.0)


@functools.cache  # every prediction asks, a recommendation hundreds of times
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 0.564 for 2, 1.029 for 4), by the
    trapezoid rule on the density of the maximum, n phi(x) Phi(x)^(n-1)."""
    if n < 2:
        return 0.0
    h = 0.01
    total = 0.0
    for i in range(-800, 801):
        x = i * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * n * phi * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) * h
    return total


def straggler_wait(cfg, strategy_cls: type, calib: Calibration, parts: dict) -> float:
    """What rank 0 waits, per step, for the slowest of the ranks it synchronises with.

    Ranks in lockstep meet at every blocking collective, so each waits out the slowest rank's
    extra compute since the last meeting. On a shared machine each process runs at its own speed
    (the same config's step moved 53-64 ms between processes; docs/plan.md), so with the ranks'
    speeds spread by a relative ``sigma`` (``scale["straggle"]``, fitted by ``bench plantime`` on the
    calibration rows' per-rank compute) a rank waits on average ``sigma x E[max of world normals]``
    of its compute. It grows with the compute, not with the bytes moved: tp cnn's two small
    all-reduces waited 3-11 ms behind 60 ms of compute, where alpha-beta said 1-3 ms. A pipeline's
    waits are its bubbles (``idle``), the single-process strategies have no ranks to wait for, and
    on a GPU each rank owns its device (no process shares a core's time with another)."""
    procs = 1 if strategy_cls.plan.single_process else cfg.world_size
    if procs < 2 or parts["idle"] > 0 or calib.device == "cuda":
        return 0.0
    return calib.scale.get("straggle", 0.0) * expected_max_normal(procs) * parts["compute"]


def _optimizer_params(cfg, strategy_cls: type, model: nn.Module, rank: int) -> tuple[float, float]:
    """(parameters, tensors) rank ``rank``'s optimizer updates: the planner's optimizer-state bytes
    over a whole replica's (ZeRO-1+/FSDP shard it, tp/pp hold slices) times the model's."""
    from parallel_lab.strategies.memory import predicted_optimizer_bytes

    sizes = [p.numel() for p in model.parameters()]
    state = strategy_cls.plan.predict_memory(cfg, model, rank) or {}
    whole = predicted_optimizer_bytes([sum(sizes)], cfg.trainer, step_counters=False)
    share = min(1.0, state.get("optim_bytes", whole) / whole) if whole else 1.0
    return sum(sizes) * share, len(sizes) * share


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf
