"""Step time at world N, predicted from measurements on this machine: the roofline-free
"compute + communication" model, with an interval for the overlap nobody can promise.

Two calibrations, both measured here (``python -m parallel_lab.bench plantime`` makes them):

* compute: a one-rank run (``strategy=single world_size=1``, one thread) at two batch sizes gives
  forward+backward = ``fixed_s + per_sample_s * samples`` and the optimizer step's time per
  parameter it updates;
* communication: the collectives benchmark (``python -m parallel_lab.bench collectives --json``)
  at several sizes, fitted per collective to Hockney's alpha-beta model (R. W. Hockney, "The
  communication challenge for MPP", Parallel Computing 20(3), 1994): one call of S bytes takes
  ``alpha + S / beta``.

A strategy's step at world N is then its share of the compute (each data-parallel rank 1/N of the
samples; tp: the split layers' FLOPs divided by the tp degree; pp: the slowest stage times the
GPipe schedule's m + p - 1 slots) plus its bytes per collective (``PlanRules.predict_comm``, the
same numbers the planner tables) through the fitted alpha-beta. Overlap is stated, not assumed:
the upper bound hides no communication; the lower bound hides, behind backward, the collectives
the strategy issues while backward runs (``PlanRules.overlapped_collectives``). Nothing here is a GPU
time. How each strategy splits the compute is its own ``PlanRules.compute_shape``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from parallel_lab.plan.alphabeta import AlphaBeta, fit_alpha_beta  # noqa: F401  (re-exported)
from parallel_lab.plan.calibrate import Calibration, load_or_measure_calibration  # noqa: F401  (re-exported)

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


def collective_seconds(
    fit: AlphaBeta, op: str, payload: float, calls: int, world: int, fit_world: int = 2
) -> tuple[float, float]:
    """(latency s, bandwidth s) of ``calls`` calls moving ``payload`` bytes in all (the bench's size:
    see COUNTED_AS) at ``world`` ranks, from a fit measured at ``fit_world``; a point-to-point send
    (``p2p``) does not scale with the world."""
    if op == "p2p":
        return calls * fit.alpha_s, payload / fit.beta_Bps
    steps, share = ring_factors(op, world)
    steps2, share2 = ring_factors(op, fit_world)
    return calls * fit.alpha_s * steps / steps2, payload / fit.beta_Bps * share / share2


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
    comm_terms: tuple[float, float] = (0.0, 0.0)  # (latency, bandwidth) s before the comm scales
    notes: list[str] = field(default_factory=list)


def _dtype(cfg) -> str:
    keys = (cfg.trainer.get("precision"), cfg.strategy.get("precision"), cfg.strategy.get("mixed_precision"))
    return "bf16" if any(str(getattr(k, "value", k)) == "bf16" for k in keys) else "fp32"


def _cores(cfg, strategy_cls: type, calib: Calibration, background_load: float) -> tuple[float, float, int]:
    """(timeslice, contention, threads): how much slower each rank's operators run because the
    ranks x threads (+ the background load) outnumber the cores, how much the ranks slow each other
    even with a core each (calibrated), and the intra-op threads that share a rank's FLOPs."""
    if calib.device == "cuda":
        return 1.0, 1.0, 1
    procs = 1 if strategy_cls.plan.single_process else cfg.world_size
    threads = cfg.trainer.get("threads") or cfg.trainer.get("threads_per_rank") or 1
    demand = procs * threads + max(0.0, background_load)
    timeslice = max(1.0, demand / calib.cpu_count)
    return timeslice, calib.contention if procs * threads > 1 else 1.0, threads


def _calls(cfg, strategy_cls: type, model: nn.Module, op: str, payload: float, shape) -> int:
    """Calls of one collective per step: the strategy's own count, else the pipeline's per
    micro-batch, else one per bucket (DDP's first bucket is 1 MiB), else one."""
    fixed = strategy_cls.plan.collective_calls(cfg, model)
    if op in fixed:
        return fixed[op]
    if shape.calls_per_collective:
        return shape.calls_per_collective
    opts = cfg.strategy
    if opts.get("bucketed") is False:
        return 1
    if opts.get("bucket_cap_mb"):
        cap = opts.bucket_cap_mb * 2**20
        return 1 + math.ceil(max(0.0, payload - 2**20) / cap)
    if opts.get("bucket_mb"):
        return max(1, math.ceil(payload / (opts.bucket_mb * 2**20)))
    return 1


def predict_comm_seconds(
    cfg, strategy_cls: type, model: nn.Module, calib: Calibration, shape, timeslice: float
) -> tuple[dict[str, float], tuple[float, float]]:
    """Seconds per collective (the counter's names) and the unscaled (latency, bandwidth) totals:
    the calibration set's scales ``comm_call`` and ``comm_byte`` weigh the two terms (in training a
    call also waits for the slower rank to arrive: what the two-process benchmark cannot see)."""
    fits = calib.collectives.get(strategy_cls.plan.comm_impl(cfg)) or next(iter(calib.collectives.values()), None)
    out: dict[str, float] = {}
    terms = [0.0, 0.0]
    scale = (calib.scale.get("comm_call", 1.0), calib.scale.get("comm_byte", 1.0))
    for op, counted in (strategy_cls.plan.predict_comm(cfg, model, 0) or {}).items():
        if not counted or fits is None:
            continue
        bench_op, per_payload = COUNTED_AS[op]
        payload = counted / per_payload
        kind = "p2p" if op in ("isend", "send") else bench_op
        calls = _calls(cfg, strategy_cls, model, op, payload, shape)
        parts = collective_seconds(AlphaBeta(**fits[bench_op]), kind, payload, calls, cfg.world_size, calib.comm_world)
        for i in (0, 1):
            terms[i] += parts[i] * timeslice
        out[op] = timeslice * (parts[0] * scale[0] + parts[1] * scale[1])
    return out, (terms[0], terms[1])


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
    ``background_load``: other runnable processes on the machine (e.g. the load average)."""
    from parallel_lab.plan.calibrate import kind_seconds
    from parallel_lab.plan.census import census_of

    plan = strategy_cls.plan
    shape = plan.compute_shape(cfg, model)
    dtype = _dtype(cfg)
    timeslice, contention, threads = _cores(cfg, strategy_cls, calib, background_load)
    census = census_of(model, shape.micro_batch, torch.bfloat16 if dtype == "bf16" else torch.float32)
    per_kind = kind_seconds(calib, census, dtype)
    per_call = sum(
        census.calls[k] * (calib.ops.get(f"{k}@{dtype}") or calib.ops[f"{k}@fp32"])["per_call_s"] for k in per_kind
    )
    units = sum(per_kind.values()) - per_call
    # Ranks time-sliced on shared cores already pay for sharing them: the larger of the two.
    one_pass = per_call * timeslice + units * max(timeslice, contention) / threads
    scale = calib.scale.get("compute", 1.0) * (calib.scale.get("bf16", 1.0) if dtype == "bf16" else 1.0)
    fwd_bwd = shape.slots * shape.flop_share * one_pass * scale
    passes = (
        cfg.trainer.global_batch
        // (plan.data_parallel_size(cfg) * shape.micro_batch)
        * cfg.strategy.get("virtual_stages", 1)
    )
    idle = fwd_bwd * max(0, shape.slots - passes) / shape.slots
    params, tensors = _optimizer_params(cfg, strategy_cls, model, 0)
    opt = calib.optimizer
    optimizer = (params * opt["per_param_s"] + tensors * opt["per_tensor_s"]) * max(timeslice, contention)
    optimizer *= calib.scale.get("optimizer", 1.0)
    comm_by_op, comm_terms = predict_comm_seconds(cfg, strategy_cls, model, calib, shape, timeslice)
    comm = sum(comm_by_op.values())
    overlapped = sum(s for op, s in comm_by_op.items() if op in plan.overlapped_collectives(cfg))
    hidden = min(overlapped * calib.scale.get("hidden", 0.5), BACKWARD_SHARE * (fwd_bwd - idle))
    exposed = comm - hidden
    point = fwd_bwd + optimizer + exposed
    q = calib.interval_log
    parts = {"compute": fwd_bwd - idle, "comm": comm, "exposed_comm": exposed, "optimizer": optimizer, "idle": idle}
    notes = [shape.note] if shape.note else []
    return StepPrediction(
        cfg.strategy.name, point, point * math.exp(-q), point * math.exp(q), parts, comm_by_op, comm_terms, notes
    )


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
