"""Is a run "the same training" as the baseline? Judged against a measured noise floor.

Why no fixed tolerance: two computations of the same training that differ only in the last bits
(another summation order, another CPU's kernels) drift apart. Adam turns a last-bit change in a
gradient that is near zero into a full ``±lr`` update of that weight, and from there the runs
separate further every step. How far depends on the model, the data, the steps and the CPU (its
three kernel libraries: ATen, oneDNN, MKL); a constant that passes on one CPU fails on the next
(docs/parity.md has the measurements, docs/facts.md the libraries).

The noise floor, measured on every comparison: the baseline (``single``) is run again with
changes that keep the training mathematically the same and move only last bits
(``noise_reruns``): every initial weight moved one ulp (one rerun per seed of ``NOISE_SEEDS``),
the gradient summed over more micro-batches (``NOISE_MICRO_BATCHES``: the reduction order data
parallelism uses), and another thread count. Their largest divergence from the baseline, step by
step, is the envelope. Several and of several kinds, because a chaotic divergence lands on a few
discrete paths and one kind of change can draw a quiet one where a strategy draws a loud one.

A row passes when
- early: over the first ``EARLY_STEPS`` steps, before chaos has amplified anything, every
  ``|Δloss|`` is within ``ENVELOPE_MULTIPLE`` x the envelope there plus a floor of
  ``FLOOR_ULPS`` float32 ulps of the loss (a real bug, such as a gradient that is not averaged,
  shows here: the envelope is a few ulps wide then);
- whole run: the largest ``|Δloss|``, the relative L2 distance of the full final parameters and
  their largest ``|Δθ|`` are each within ``ENVELOPE_MULTIPLE`` x the envelope's (largest over the
  noise runs) plus a floor. Under Adam the parameter floors are one weight moved by the most Adam
  can move it (``adam_element_bound``): Adam's gain on a gradient within rounding of zero is
  ``lr / eps``, so whether a run holds one such weight is a coin toss per run and per CPU.
Whole-run maxima, not step-by-step ratios, after the early window: when the paths separate is
itself random (measured: the same divergence arrived 2-4 steps apart), so step-by-step ratios
swing by 100x while the size of the divergence does not.

Beside them, exact (``Replicas``): the run's data-parallel replicas must end bit for bit equal
(metrics.json ``replica_digests_agree``, parallel_lab/worker/replicas.py). It catches what the
whole-run envelope leaves within reach: a synchronisation missed after the early window.

The ratio shown is ``divergence / (envelope + floor / ENVELOPE_MULTIPLE)``: a row passes when
every ratio is at most ``ENVELOPE_MULTIPLE``. ``python -m parallel_lab.bench parity_robustness``
measures how often a real run fails that (false alarms) across CPU kernel dispatches.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the gaps are taken on tensors that whoever loaded them brought (a report of runs
    import torch  # without a baseline never needs torch)

ENVELOPE_MULTIPLE = 10.0  # the pass bound; real runs measured at most 0.29 of it over 18 CPU dispatches
EARLY_STEPS = 5  # where bugs show at 100-100,000x the envelope (docs/parity.md), before chaos widens it
FLOOR_ULPS = 8  # the absolute floor, in float32 units in the last place of the compared value
NOISE_SEEDS = (1, 2, 3)  # ulp-jitter seeds: one noise-floor rerun of the baseline per seed
NOISE_MICRO_BATCHES = (2, 4)  # the baseline's batch also summed in this many micro-batches (where it divides)
NOISE_GRAD_SEEDS = (1,)  # gradient-rounding reruns: every gradient moved by rounding noise (worker/noise.py)
ADAM_OPTIMIZERS = ("adam", "adamw")  # trainer.optimizer values whose updates have Adam's high gain
VERDICT_LOG_ENV = "PARALLEL_LAB_PARITY_LOG"  # a file: every verdict appended as one JSON line (bench)


def noise_reruns(
    global_batch: int, grad_accum: int, threads: int, batch_statistics: bool = False
) -> dict[str, dict[str, int]]:
    """The noise floor's reruns of a baseline: {label: the trainer.* values that change}. Each is
    the same training with other last bits: every initial weight moved one ulp (one per seed of
    NOISE_SEEDS); every step's gradient moved by its rounding noise (NOISE_GRAD_SEEDS); the
    gradient summed over more micro-batches (the reduction order data parallelism and
    accumulation use); another intra-op thread count (another order inside the kernels).
    docs/parity.md has the measurements that chose this set. batch_statistics (a BatchNorm model):
    no micro-batch reruns, since BatchNorm normalising over smaller micro-batches is another
    training, not another rounding (docs/batchnorm.md)."""
    reruns = {f"ulp_jitter_seed={seed}": {"ulp_jitter_seed": seed} for seed in NOISE_SEEDS}
    reruns |= {f"grad_ulp_seed={seed}": {"grad_ulp_seed": seed} for seed in NOISE_GRAD_SEEDS}
    for k in () if batch_statistics else NOISE_MICRO_BATCHES:
        if global_batch % (grad_accum * k) == 0:
            reruns[f"micro_batches={grad_accum * k}"] = {"grad_accum": grad_accum * k}
    other_threads = 1 if threads > 1 else 2
    reruns[f"threads={other_threads}"] = {"threads": other_threads}
    return reruns


def ulp(value: float) -> float:
    """Spacing of float32 numbers at value: the smallest change a float32 result can show."""
    return float(np.spacing(np.float32(abs(value))))


@dataclass
class Gaps:
    """How far one run is from the baseline."""

    loss: list[float]  # |Δloss| per step
    rel_l2: float  # ||θ - θ_base|| / ||θ_base|| over every full parameter
    max_abs: float  # max |θ - θ_base| over every parameter element


def gaps(
    losses: list[float], params: dict[str, torch.Tensor], base_losses: list[float], base_params: dict[str, torch.Tensor]
) -> Gaps:
    if len(losses) != len(base_losses):
        raise ValueError(f"{len(losses)} losses vs the baseline's {len(base_losses)}")
    if set(params) != set(base_params):
        raise ValueError(f"parameter names differ from the baseline's: {sorted(set(params) ^ set(base_params))[:4]}")
    diff_sq = sum(float((params[k].double() - base_params[k].double()).pow(2).sum()) for k in base_params)
    base_sq = sum(float(base_params[k].double().pow(2).sum()) for k in base_params)
    max_abs = max(float((params[k] - base_params[k]).abs().max()) for k in base_params)
    return Gaps([abs(a - b) for a, b in zip(losses, base_losses)], math.sqrt(diff_sq / base_sq), max_abs)


def envelope(noise: list[Gaps]) -> Gaps:
    """The noise floor: step by step, the largest gap of any noise run."""
    return Gaps(
        [max(step) for step in zip(*(g.loss for g in noise))],
        max(g.rel_l2 for g in noise),
        max(g.max_abs for g in noise),
    )


@dataclass
class Check:
    value: float
    envelope: float
    floor: float

    @property
    def ratio(self) -> float:
        denominator = self.envelope + self.floor / ENVELOPE_MULTIPLE
        return self.value / denominator if denominator > 0 else math.inf

    @property
    def passed(self) -> bool:
        return self.ratio <= ENVELOPE_MULTIPLE


@dataclass
class Replicas:
    """The exact complement of the checks above: did the run's data-parallel replicas end bit for
    bit equal (metrics.json ``replica_*``, parallel_lab/worker/replicas.py)? No envelope: a missed
    all-reduce after the early window stays within the whole-run envelope but splits the replicas.
    agree None: no two ranks held the same parameter (nothing to compare; not a pass of the check)."""

    agree: bool | None
    disagree: list[dict]  # [{ranks, params (the first few), count}]

    @classmethod
    def of(cls, record) -> Replicas:
        """From a RunMetrics or a metrics.json dict (a record without the fields: agree None)."""
        get = record.get if isinstance(record, dict) else lambda k, d=None: getattr(record, k, d)
        return cls(get("replica_digests_agree"), get("replica_groups_disagree") or [])

    @property
    def passed(self) -> bool:
        return self.agree is not False

    def reason(self) -> str:
        return "; ".join(
            f"replicas differ: ranks {', '.join(map(str, g['ranks']))} hold {g['count']} parameters with "
            f"different bytes (e.g. {g['params'][0]})"
            for g in self.disagree
        )


@dataclass
class Verdict:
    early_dloss: Check
    max_dloss: Check
    param_rel_l2: Check
    param_max_abs: Check
    replicas: Replicas | None = None  # None: the run's replicas were not checked (a test's own loop)

    @property
    def passed(self) -> bool:
        return self.criterion_passed and (self.replicas is None or self.replicas.passed)

    @property
    def criterion_passed(self) -> bool:
        """The four checks against the noise envelope alone, without the replica check."""
        return all(check.passed for check in self.checks().values())

    def checks(self) -> dict[str, Check]:
        return {
            "early_dloss": self.early_dloss,
            "max_dloss": self.max_dloss,
            "param_rel_l2": self.param_rel_l2,
            "param_max_abs": self.param_max_abs,
        }

    def reason(self) -> str:
        """The failed checks in words ('' when it passes)."""
        failed = [
            f"{name} {c.value:.2g} is {c.ratio:.3g}x the envelope {c.envelope:.2g} (> {ENVELOPE_MULTIPLE:g}x)"
            for name, c in self.checks().items()
            if not c.passed
        ]
        return "; ".join(failed + ([self.replicas.reason()] if self.replicas and not self.replicas.passed else []))

    def as_dict(self) -> dict:
        out = {name: {**asdict(c), "ratio": c.ratio} for name, c in self.checks().items()}
        # Flat, not one more dict: readers take every dict value here for a ratio check (comparison.json)
        rep = self.replicas or Replicas(None, [])
        out |= {"replicas_agree": rep.agree, "replicas_disagree": rep.disagree}
        return {**out, "passed": self.passed, "reason": self.reason()}


def adam_element_bound(lr: float, steps: int) -> float:
    """How far one weight can move apart in two Adam runs of ``steps`` steps: each update is about
    ``lr`` in size whatever the gradient's scale (``m̂ / √v̂``), so at most ``2 · lr`` a step."""
    return 2.0 * lr * steps


def judge(
    row: Gaps,
    env: Gaps,
    base_losses: list[float],
    base_params: dict[str, torch.Tensor],
    adam_lr: float | None = None,
    replicas: Replicas | None = None,
) -> Verdict:
    """The parity verdict of one run, given its gaps and the noise envelope (module docstring).
    adam_lr: the run's Adam learning rate (None for another optimizer): raises the parameter
    floors to one weight moved by ``adam_element_bound`` (module docstring: Adam's high gain).
    replicas: the run's replica check (Replicas.of its metrics): a row whose replicas differ fails."""
    early = min(EARLY_STEPS, len(row.loss))
    loss_floor = FLOOR_ULPS * ulp(max(abs(v) for v in base_losses))
    theta_max = max(float(p.abs().max()) for p in base_params.values())
    rel_floor = FLOOR_ULPS * float(np.finfo(np.float32).eps)
    abs_floor = FLOOR_ULPS * ulp(theta_max)
    if adam_lr is not None:
        one_weight = adam_element_bound(adam_lr, len(base_losses))
        theta_norm = math.sqrt(sum(float(p.double().pow(2).sum()) for p in base_params.values()))
        rel_floor, abs_floor = max(rel_floor, one_weight / theta_norm), max(abs_floor, one_weight)
    # Early, step by step against the largest the noise had reached by that step: a bug shows from
    # the first update on, while the noise (its gradient reruns) grows over the window.
    env_so_far = list(itertools.accumulate(env.loss[:early], max))
    early_check = max((Check(row.loss[k], env_so_far[k], loss_floor) for k in range(early)), key=lambda c: c.ratio)
    return Verdict(
        early_dloss=early_check,
        max_dloss=Check(max(row.loss), max(env.loss), loss_floor),
        param_rel_l2=Check(row.rel_l2, env.rel_l2, rel_floor),
        param_max_abs=Check(row.max_abs, env.max_abs, abs_floor),
        replicas=replicas,
    )


def judge_runs(
    run: tuple[list[float], dict],
    baseline: tuple[list[float], dict],
    noise_runs: list[tuple[list[float], dict]],
    adam_lr: float | None = None,
    replicas: Replicas | None = None,
) -> Verdict:
    """judge() from (losses, params) pairs: the run, the baseline, and the baseline's noise reruns."""
    env = envelope([gaps(*noise, *baseline) for noise in noise_runs])
    return judge(gaps(*run, *baseline), env, *baseline, adam_lr=adam_lr, replicas=replicas)


def adam_lr_of(optimizer: str, lr: float) -> float | None:
    """The lr judge() takes for the Adam floors: lr for the Adam family, None otherwise."""
    return lr if optimizer in ADAM_OPTIMIZERS else None


def log_verdict(label: str, verdict: Verdict, expect_pass: bool = True) -> None:
    """Append the verdict to the file named by $PARALLEL_LAB_PARITY_LOG, if set: how
    ``python -m parallel_lab.bench parity_robustness`` collects every judgement the tests make
    (the test's id from pytest's $PYTEST_CURRENT_TEST, the rank, the expected outcome)."""
    path = os.environ.get(VERDICT_LOG_ENV)
    if not path:
        return
    record = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "label": label,
        "rank": int(os.environ.get("RANK", "0")),
        "expect_pass": expect_pass,
        "passed": verdict.passed,
        "replicas_agree": verdict.replicas.agree if verdict.replicas else None,
        "ratios": {name: check.ratio for name, check in verdict.checks().items()},
    }
    with open(path, "a") as f:  # one short write per line: appends from several ranks stay whole
        f.write(json.dumps(record) + "\n")
