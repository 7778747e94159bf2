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


@dataclass(frozen=True)
class AlphaBeta:
    """One collective's cost: ``calls * alpha_s + payload_bytes / beta_Bps`` (Hockney)."""

    alpha_s: float
    beta_Bps: float

    def seconds(self, payload_bytes: float, calls: int = 1) -> float:
        return calls * self.alpha_s + payload_bytes / self.beta_Bps


def fit_alpha_beta(points: list[tuple[float, float]]) -> AlphaBeta:
    """Least squares of ``t = alpha + S / beta`` over (S bytes, t seconds) points, in relative
    error (each row divided by its t), so the 4 KiB points set alpha and the 16 MiB ones beta
    instead of the largest size deciding both. alpha is clamped at 0."""
    if len(points) < 2:
        raise ValueError(f"an alpha-beta fit needs at least 2 sizes, got {len(points)}")
    a = torch.tensor([[1.0 / t, s / t] for s, t in points], dtype=torch.float64)
    b = torch.ones(len(points), 1, dtype=torch.float64)
    alpha, inv_beta = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    if inv_beta <= 0:
        raise ValueError(f"alpha-beta fit gave no positive bandwidth from {points}")
    if alpha < 0:  # refit the slope alone through the origin
        alpha = 0.0
        inv_beta = sum(s / t for s, t in points) / sum((s / t) ** 2 for s, t in points)
    return AlphaBeta(alpha, 1.0 / inv_beta)


@dataclass(frozen=True)
class Compute:
    """One rank, one thread: forward+backward of a micro-batch and the optimizer step."""

    fixed_s: float  # the line's intercept: dispatch and loss cost, minus any per-sample growth with batch
    per_sample_s: float
    per_param_s: float  # optimizer step, per parameter it updates

    def fwd_bwd(self, samples: float, share: float = 1.0) -> float:
        """``share`` of the model's work (FLOPs) on ``samples`` samples."""
        return share * max(0.0, self.fixed_s + self.per_sample_s * samples)

    def optimizer(self, params: float) -> float:
        return self.per_param_s * params


def fit_compute(small: tuple[int, float], large: tuple[int, float], optimizer_s: float, params: int) -> Compute:
    """From two one-rank runs, (batch, forward+backward s) each, and the optimizer step's seconds
    for ``params`` parameters: the line through the two points."""
    (b1, t1), (b2, t2) = small, large
    if b1 == b2:
        raise ValueError(f"the compute calibration needs two different batch sizes, got {b1} twice")
    per_sample = (t2 - t1) / (b2 - b1)
    if per_sample <= 0:  # noise larger than the work of the extra samples (a loaded machine): flat
        return Compute(fixed_s=(t1 + t2) / 2, per_sample_s=0.0, per_param_s=optimizer_s / params)
    # The intercept may be negative (per-sample cost growing with the batch: caches): the line still
    # passes through both measured points, which are the batch sizes data-parallel ranks run.
    return Compute(fixed_s=t1 - per_sample * b1, per_sample_s=per_sample, per_param_s=optimizer_s / params)


@dataclass
class StepPrediction:
    """One strategy's predicted step, in seconds, and what it is made of."""

    strategy: str
    fwd_bwd_s: float
    optimizer_s: float
    comm_s: dict[str, float]  # by bench op
    overlappable_s: float  # the part of comm_s the strategy issues during backward
    notes: list[str] = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return self.fwd_bwd_s + self.optimizer_s

    @property
    def upper_s(self) -> float:
        """No overlap: every collective waits for compute and compute for it."""
        return self.compute_s + sum(self.comm_s.values())

    @property
    def lower_s(self) -> float:
        """Full overlap of the collectives issued during backward with backward's compute."""
        exposed = sum(self.comm_s.values()) - self.overlappable_s
        hidden_behind = BACKWARD_SHARE * self.fwd_bwd_s
        return self.compute_s + exposed + max(0.0, self.overlappable_s - hidden_behind)


def comm_seconds(
    comm_bytes: dict[str, float], fits: dict[str, AlphaBeta], calls: dict[str, int] | None = None
) -> dict[str, float]:
    """Seconds per bench op for the counted bytes per step (``predict_comm``'s units), one call
    per op unless ``calls`` says more (latency counted once per collective kind: a lower bound
    on alpha's share when a strategy splits its volume into buckets)."""
    out: dict[str, float] = {}
    for op, counted in comm_bytes.items():
        if not counted:
            continue
        bench_op, per_payload = COUNTED_AS[op]
        n = (calls or {}).get(op, 1)
        out[bench_op] = out.get(bench_op, 0.0) + fits[bench_op].seconds(counted / per_payload, n)
    return out


# ---- one strategy ----------------------------------------------------------------------------------
def _optimizer_params(cfg, strategy_cls: type, model: nn.Module, rank: int) -> float:
    """Parameters rank ``rank``'s optimizer updates: the planner's optimizer-state bytes over a
    whole replica's (ZeRO-1+/FSDP shard it, tp/pp hold slices), times the model's parameters."""
    from parallel_lab.strategies.memory import predicted_optimizer_bytes

    params = sum(p.numel() for p in model.parameters())
    state = strategy_cls.plan.predict_memory(cfg, model, rank) or {}
    whole = predicted_optimizer_bytes([params], cfg.trainer, step_counters=False)
    return params * min(1.0, state.get("optim_bytes", whole) / whole) if whole else params


def predict_step(
    cfg, strategy_cls: type, model: nn.Module, compute: Compute, fits: dict[str, dict[str, AlphaBeta]]
) -> StepPrediction:
    """Rank 0's step (metrics.json times rank 0) for a validated config: compute split as the
    strategy splits the work, communication from ``predict_comm`` through the alpha-beta fits
    (``fits[impl][op]``: impl ``gloo`` for torch.distributed, ``hand`` for manual_ddp's own ring)."""
    name, world = cfg.strategy.name, cfg.world_size
    comm_bytes = strategy_cls.plan.predict_comm(cfg, model, 0) or {}
    shape = strategy_cls.plan.compute_shape(cfg, model)
    fwd_bwd = shape.slots * compute.fwd_bwd(shape.micro_batch, shape.flop_share)
    calls = {op: shape.calls_per_collective for op in comm_bytes} if shape.calls_per_collective else {}
    notes = [shape.note] if shape.note else []
    optimizer = compute.optimizer(_optimizer_params(cfg, strategy_cls, model, 0))
    comm = comm_seconds(comm_bytes, fits[strategy_cls.plan.comm_impl(cfg)], calls)
    overlapped = strategy_cls.plan.overlapped_collectives(cfg)
    hidden = sum(s for op, s in comm.items() if op in overlapped)
    if world < 2:
        notes.append("one process: no communication")
    return StepPrediction(name, fwd_bwd, optimizer, comm, hidden, notes)


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf
