"""The runs of a comparison, judged: each ``Row`` (a run's record, finished or failed), how runs are
read from folders (``load_runs``), which runs share a ``single`` baseline (``baseline_key``) and the
parity verdict of every row against it and its noise-floor reruns (``add_parity``, the criterion in
``parity.py``). The columns read from these rows: ``columns.py``; the tables written: ``table.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from parallel_lab.protocol import FAILED_FILE, METRICS_FILE, PARAMS_FILE, FailedRun, RunMetrics, load_final_params
from parallel_lab.report.parity import Replicas, adam_lr_of, envelope, gaps, judge
from parallel_lab.threads import torch_threads


@dataclass
class Row:
    """One run of the comparison: its record and, once judged, its parity verdict."""

    run_dir: str
    metrics: RunMetrics | None = None  # the run finished (metrics.json)
    failure: FailedRun | None = None  # it did not (failed.json)
    parity: str = ""
    variant: str = ""  # the options that tell this row from other rows of its strategy (mark_variants)
    parity_checks: dict = field(default_factory=dict)
    dloss_per_step: list[float] | None = None
    noise_envelope_per_step: list[float] | None = None
    rounds: list[RunMetrics] = field(default_factory=list)  # the same run's later rounds (trainer.rounds)
    timing: dict = field(default_factory=dict)  # name -> intervals.Interval (report/timing.py add_timing)
    vs_baseline: str = ""  # faster / slower / same within noise than its `single` (timing.py)
    gflops_per_rank: float | None = None  # model FLOPs per rank per second, in GFLOP/s
    peak: dict | None = None  # the machine's measured peak for this row's dtype and threads

    @property
    def record(self) -> RunMetrics | FailedRun:
        return self.metrics or self.failure

    @property
    def ok(self) -> bool:
        return self.metrics is not None

    @property
    def is_noise(self) -> bool:
        """A noise-floor rerun of the baseline (report/parity.py)."""
        return self.ok and (self.metrics.noise_rerun or self.metrics.ulp_jitter_seed) is not None

    def to_json(self, timing: dict | None = None) -> dict:
        """comparison.json: the record's fields, where it lives, the verdict with its evidence, and
        ``timing`` (report/timing.py timing_json: the intervals, FLOPs and MFU)."""
        out = {**self.record.to_json(), "run_dir": self.run_dir, "parity": self.parity, **(timing or {})}
        if self.parity_checks:
            out.update(
                dloss_per_step=self.dloss_per_step,
                noise_envelope_per_step=self.noise_envelope_per_step,
                parity_checks=self.parity_checks,
            )
        return out


ROUNDS_DIR = "rounds"  # <sweep>/rounds/r<k>/<run folder>: round k of a sweep's run (trainer.rounds)


def _round_of(path: Path, top: Path) -> tuple[int, str] | None:
    """(k, the run folder's name) for a metrics.json of a later round, None for any other run."""
    parts = path.parent.relative_to(top).parts
    if len(parts) >= 3 and parts[-3] == ROUNDS_DIR and re.fullmatch(r"r\d+", parts[-2]):
        return int(parts[-2][1:]), parts[-1]
    return None


def load_runs(dirs: list[Path]) -> list[Row]:
    """The runs under the folders, sorted (noise-floor reruns last); a run's later rounds are no
    rows of their own but the ``rounds`` of the row whose folder has their name."""
    runs, later = [], []
    for top in dirs:
        for path in sorted(top.rglob(METRICS_FILE)):
            round_of = _round_of(path, top)
            if round_of:
                later.append((round_of, top, RunMetrics.read(path)))
            else:
                runs.append(Row(str(path.parent), metrics=RunMetrics.read(path)))
        runs += [Row(str(path.parent), failure=FailedRun.read(path)) for path in sorted(top.rglob(FAILED_FILE))]
    by_folder = {(Path(r.run_dir).parent, Path(r.run_dir).name): r for r in runs}
    for (_, name), top, metrics in sorted(later, key=lambda item: item[0][0]):
        owner = by_folder.get((top, name))
        if owner is not None:
            owner.rounds.append(metrics)
    return sorted(runs, key=lambda r: (r.is_noise, _natural(r.run_dir)))


def _natural(text: str) -> list:
    """Sort key that puts a sweep's 2_ddp before 10_zero3 (numbers compared as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def precision_of(m: RunMetrics) -> str:
    """The run's compute precision, from its strategy's own key (strategy.precision, fsdp's
    strategy.mixed_precision): fp32 or bf16."""
    opts = m.strategy_options or {}
    return opts.get("precision") or opts.get("mixed_precision") or "fp32"


def baseline_key(run: Row) -> tuple:
    """Runs that train the same thing (and so compare with one single baseline): a bf16 row is
    judged against `single` in bf16 and that baseline's own noise reruns."""
    m = run.metrics
    if not m:
        return (run.failure.model,)
    # norm: a BatchNorm row is judged against single with the same layers (and its own reruns);
    # params: an MoE vit (model.moe_experts) is another network than the dense vit of the same name.
    return (m.model, m.params, m.global_batch, m.steps, m.data, m.optimizer, m.lr, precision_of(m), m.norm)


def is_baseline(run: Row) -> bool:
    return run.ok and run.metrics.strategy == "single" and not run.is_noise


def _losses_params(run: Row) -> tuple[list[float], dict] | None:
    params = load_final_params(Path(run.run_dir))
    return None if params is None else (run.metrics.losses, params)


def add_parity(runs: list[Row]) -> None:
    """Judge every ok run against the single baseline of the same setup and that baseline's
    noise-floor reruns (report/parity.py): fills each row's parity and parity_checks."""
    # torch (where already imported) on one thread meanwhile: the gaps are a few hundred small
    # tensor operations, where a second thread only adds its hand-off (the demo's report: 12-14.5 s
    # of CPU on two threads, 10 s on one, measured on 2 busy cores).
    with torch_threads(1, only_if_imported=True):
        _add_parity(runs)


def _add_parity(runs: list[Row]) -> None:
    for key in {baseline_key(r) for r in runs}:
        group = [r for r in runs if baseline_key(r) == key]
        base = next((r for r in group if is_baseline(r)), None)
        noise = [r for r in group if r.is_noise]
        base_pair = _losses_params(base) if base else None
        noise_pairs = [p for p in map(_losses_params, noise) if p is not None]
        env = envelope([gaps(*n, *base_pair) for n in noise_pairs]) if base_pair and noise_pairs else None
        base_samples = base.metrics.batchnorm.get("samples") if base and base.metrics.batchnorm else None
        for run in group:
            _judge_one(run, base_pair, env, base_samples)


def _judge_one(run: Row, base_pair, env, base_samples: list[int] | None = None) -> None:
    pair = _losses_params(run) if run.ok else None
    if not run.ok:
        run.parity = "failed"
    elif base_pair is None:
        run.parity = "no baseline"
    elif pair is None:
        run.parity = f"no {PARAMS_FILE}"
    elif env is None:
        run.parity = "no noise floor"
    else:
        gap = gaps(*pair, *base_pair)
        adam_lr, replicas = adam_lr_of(run.metrics.optimizer, run.metrics.lr), Replicas.of(run.metrics)
        verdict = judge(gap, env, *base_pair, adam_lr=adam_lr, replicas=replicas)
        run.dloss_per_step, run.noise_envelope_per_step = gap.loss, env.loss
        run.parity_checks = verdict.as_dict()
        run.parity = "envelope" if run.is_noise else ("pass" if verdict.passed else _not_passed(run, base_samples))


DIFFERS = "differs by design"  # a parity verdict: another training than single's, on purpose, measured


def _not_passed(run: Row, base_samples: list[int] | None) -> str:
    """FAIL, or "differs by design" when BatchNorm normalised over other samples than the
    baseline's (plain BatchNorm under data or pipeline parallelism: docs/batchnorm.md)."""
    samples = run.metrics.batchnorm.get("samples") if run.metrics.batchnorm else None
    if samples and base_samples and samples != base_samples:
        return f"{DIFFERS}: BatchNorm statistics over {'/'.join(map(str, samples))} local samples"
    return "FAIL"
