"""``python -m parallel_lab.plan plan.recommend=true``: every candidate (``plan/candidates.py``)
predicted, with no run, for memory (the planner's exact per-rank prediction, ``plan_world``: a
candidate fits when the rank holding the most fits ``plan.device_memory``) and step time (the
step-time model, ``plan/steptime.py``, on this machine's calibration), then ranked by predicted
samples/s among those that fit. Each loser says why it lost: over the cap (by how much), or the
part of its predicted step that grew most against the winner's (communication, bubble, compute,
optimizer). Writes recommend.md / recommend.json into the plan's out folder.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from parallel_lab.plan.candidates import Candidate, candidates, one_world, with_levers
from parallel_lab.plan.output import human, worst_rank
from parallel_lab.plan.predict import SavedBytesCache, Values, plan_world

NO_COMM = "time: not predicted (no communication rule for this layout)"
# The additive parts of a predicted step (StepPrediction.parts) -> the word a loser's reason uses.
PART_WORDS = {"exposed_comm": "communication", "idle": "bubble", "compute": "compute", "optimizer": "optimizer"}


@dataclass
class Ranked:
    """One candidate with its predictions; ``rank`` 1 is the recommendation (0: over the cap)."""

    candidate: Candidate
    peak_bytes: int | None  # the rank holding the most (plan_world), None: no prediction
    worst_rank: int
    step_s: float  # predicted step, its point
    step_low_s: float
    step_high_s: float
    parts: dict[str, float] = field(default_factory=dict)  # seconds by part (compute, exposed_comm, idle, ...)
    fits: bool = False
    rank: int = 0
    why: str = ""
    unknown: str = ""  # why no step time is predicted (then it is never ranked), "" when it is

    @property
    def ranked_by_time(self) -> bool:
        return self.fits and not self.unknown

    @property
    def global_batch(self) -> int:
        return int(self.candidate.cfg.trainer.global_batch)

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s

    @property
    def samples_per_s_interval(self) -> tuple[float, float]:
        return self.global_batch / self.step_high_s, self.global_batch / self.step_low_s

    def to_json(self) -> dict:
        low, high = self.samples_per_s_interval
        if not math.isfinite(self.step_s):  # not predicted (over the cap, or no rule): json has no infinity
            keys = ("rank", "fits", "peak_bytes", "worst_rank", "why")
            return {"strategy": self.candidate.strategy, "overrides": self.candidate.overrides,
                    **{k: getattr(self, k) for k in keys}}  # fmt: skip
        return {
            "rank": self.rank,
            "strategy": self.candidate.strategy,
            "overrides": self.candidate.overrides,
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "worst_rank": self.worst_rank,
            "predicted_samples_per_s": self.samples_per_s,
            "predicted_samples_per_s_interval": [low, high],
            "predicted_step_s": self.step_s,
            "predicted_step_s_interval": [self.step_low_s, self.step_high_s],
            "parts_s": self.parts,
            "why": self.why,
        }


# ---- the step-time model: the one place the recommender calls it ------------------------------------
def load_calibration(path: str | None = None, precision: str = "fp32"):
    """This machine's step-time calibration (cached, or measured in a few seconds: no training run),
    with the operator lines of the run's precision (the candidates train in it; fp32 is always there)."""
    from parallel_lab.plan.steptime import load_or_measure_calibration

    return load_or_measure_calibration(path, dtypes=("fp32", str(precision)))


def predict_time(cfg, strategy_cls: type, model, calib) -> tuple[float, float, float, dict[str, float]]:
    """(point, low, high seconds, parts) of one candidate's step: ``steptime.predict_step``."""
    from parallel_lab.plan.steptime import predict_step

    p = predict_step(cfg, strategy_cls, model, calib)
    parts = {k: float(v) for k, v in (p.parts or {}).items() if isinstance(v, (int, float))}
    return float(p.point_s), float(p.low_s), float(p.high_s), parts


# ---- ranking -------------------------------------------------------------------------------------------
def fits(peak_bytes: int | None, cap_bytes: int) -> bool:
    """The planner's notion: the rank holding the most fits the device (output.fit_text)."""
    return peak_bytes is not None and peak_bytes <= cap_bytes


def predict_all(cands: list[Candidate], calib, cap_bytes: int) -> tuple[list[Ranked], int]:
    """Memory and time of every candidate (one meta model per model config, forwards shared), and
    of the memory-lever variants of each that does not fit; (predictions, lever variants left out
    because the candidate without them fits: a lever only adds work, so it cannot win there)."""
    from omegaconf import OmegaConf

    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.metamemo import MetaMemo
    from parallel_lab.strategies import get_strategy_class

    models: dict[str, object] = {}
    cache = SavedBytesCache()

    def one(c: Candidate) -> Ranked:
        key = repr(OmegaConf.to_container(c.cfg.model))  # a yaml dump costs 3x
        if key not in models:  # not setdefault: its argument, a whole model, would be built every time
            models[key] = build_meta_model(c.cfg.model)
        model = models[key]
        strategy_cls = get_strategy_class(c.strategy)
        # Plain values, read once: the step model reads the config thousands of times a candidate,
        # and through OmegaConf each read cost more than its arithmetic (predict.Values).
        cfg = Values.of(OmegaConf.to_container(c.cfg, resolve=True))
        plans = plan_world(cfg, strategy_cls, model, cache)
        worst = worst_rank(plans)
        inf = math.inf
        if not fits(worst.total_bytes, cap_bytes):  # ranked by memory alone: its time is not needed
            return Ranked(c, worst.total_bytes, worst.rank, inf, inf, inf)
        if cfg.world_size > 1 and any(p.comm is None for p in plans):
            # No rule for its communication (HSDP, FSDP1, FSDP2 x TP): a time without it would be
            # a step with free communication, so it is listed, never ranked.
            return Ranked(c, worst.total_bytes, worst.rank, inf, inf, inf, unknown=NO_COMM)
        point, low, high, parts = predict_time(cfg, strategy_cls, model, calib)
        return Ranked(c, worst.total_bytes, worst.rank, point, min(low, point), max(high, point), parts)

    out, left_out = [], 0
    with MetaMemo():  # the candidates' meta passes repeat a few shapes: each meta kernel runs once per shape
        for c in cands:
            out.append(one(c))
            if fits(out[-1].peak_bytes, cap_bytes):
                left_out += len(c.levers)
            else:
                out += [one(v) for v in with_levers(c)]
    return out, left_out


def rank(items: list[Ranked], cap_bytes: int) -> list[Ranked]:
    """Those that fit first, by predicted samples/s (highest first; ties keep the search order, each
    strategy as configured first), then those over the cap by how far over. Sets rank and why."""
    for r in items:
        r.fits = fits(r.peak_bytes, cap_bytes)
    fit = sorted((r for r in items if r.ranked_by_time), key=lambda r: -r.samples_per_s)
    unknown = [r for r in items if r.fits and r.unknown]
    over = sorted((r for r in items if not r.fits), key=lambda r: (r.peak_bytes is None, r.peak_bytes or 0))
    for i, r in enumerate(fit, start=1):
        r.rank = i
    for r in unknown + over:
        r.rank = 0
    winner = fit[0] if fit else None
    for r in fit + unknown + over:
        r.why = why_lost(r, winner, cap_bytes)
    return fit + unknown + over


def why_lost(r: Ranked, winner: Ranked | None, cap_bytes: int) -> str:
    """'memory: X over the cap', or the predicted part that grew most against the winner's step."""
    if r.peak_bytes is None:
        return "memory: no prediction (the strategy brings no memory rule)"
    if not r.fits:
        return f"memory: {human(r.peak_bytes - cap_bytes)} over the cap ({human(r.peak_bytes)} on rank {r.worst_rank})"
    if r.unknown:
        return r.unknown
    if winner is None or r is winner:
        return "recommended" if r is winner else ""
    if r.step_s <= winner.step_s * (1 + 1e-9):
        return "ties with #1 (the same predicted step; after it in search order)"
    extra = {word: r.parts.get(part, 0.0) - winner.parts.get(part, 0.0) for part, word in PART_WORDS.items()}
    word, seconds = max(extra.items(), key=lambda kv: kv[1])
    overlap = r.step_low_s <= winner.step_high_s
    net = 1000 * (r.step_s - winner.step_s)
    if seconds <= 0:  # no part grew: the step itself is longer by rounding or the global batch differs
        return f"slower by {net:.2f} ms/step" + (" (intervals overlap)" if overlap else "")
    # The part that grew most, and the net: another part may have shrunk (e.g. sharding: less optimizer)
    return f"{word}: +{1000 * seconds:.2f} ms/step (step +{net:.2f} ms" + ("; intervals overlap)" if overlap else ")")


@dataclass
class Recommendation:
    ranked: list[Ranked]
    cap_bytes: int
    cap_source: str
    seconds: float  # wall time of enumerate + predict + rank
    header: str


def recommend(
    overrides: list[str], cap_bytes: int, cap_source: str, calib=None, cfg=None, pending=None
) -> Recommendation:
    """Enumerate, predict and rank every candidate for these overrides at their world size (``cfg``:
    their composed config where the caller has it, else composed here; ``pending``: the candidates
    as ``candidates.candidates_started`` returned them, else enumerated here)."""
    from parallel_lab.config import compose_config
    from parallel_lab.errors import ConfigError

    start = time.perf_counter()
    cfg = compose_config(overrides) if cfg is None else cfg
    one_world(cfg)
    calib = calib if calib is not None else load_calibration(precision=cfg.trainer.precision)
    cands = pending() if pending is not None else candidates(overrides, cfg)
    if not cands:
        raise ConfigError(f"no configuration of {overrides or 'the defaults'} passes the run's validation; see plan.md")
    predicted, left_out = predict_all(cands, calib, cap_bytes)
    ranked = rank(predicted, cap_bytes)
    seconds = time.perf_counter() - start
    fitting = sum(r.fits for r in ranked)
    unknown = sum(bool(r.unknown) for r in ranked if r.fits)
    header = (
        f"Recommendation: model={cfg.model.name}, world_size={cfg.world_size}, global batch "
        f"{cfg.trainer.global_batch}, optimizer {cfg.trainer.optimizer}, precision {cfg.trainer.precision}; cap "
        f"{human(cap_bytes)} per rank ({cap_source}). {len(ranked)} candidates, {fitting} fit"
        + (f" ({unknown} with no time prediction: listed, not ranked)" if unknown else "")
        + f"; ranked by predicted "
        f"samples/s in {seconds:.1f} s, no run (time is predicted for those that fit only). Memory levers "
        f"(trainer.grad_accum, trainer.recompute) tried where a candidate does not fit: {left_out} lever variants of "
        f"candidates that fit left out (a lever only adds work)."
    )
    return Recommendation(ranked, cap_bytes, cap_source, seconds, header)


def run(overrides: list[str], cap_bytes: int, cap_source: str, out: Path, cfg=None, pending=None) -> Path:
    """recommend() and its files, recommend.md / recommend.json, under ``out``."""
    from parallel_lab.plan.recommend_output import write_recommendation

    rec = recommend(overrides, cap_bytes, cap_source, cfg=cfg, pending=pending)
    out.mkdir(parents=True, exist_ok=True)
    write_recommendation(rec, out)
    return out / "recommend.md"
