"""Turn metrics.json files into the comparison: comparison.md/.csv/.json (the plots: ``plots.py``;
both: ``write.py``).

Every row carries its proof: the loss difference against the ``single`` baseline found among the
same runs (same model, global batch and steps), and a pass/fail parity mark. comparison.md shows
what a reader compares (``MD_COLUMNS``, every number to ``DIGITS`` significant digits);
comparison.csv has every column (``COLUMNS``) unrounded, comparison.json every record. Failed runs
(failed.json) appear as rows with their error, and the rest of the report still renders. Runs are
read as the records the workers and the parent wrote (``protocol.RunMetrics`` / ``FailedRun``).
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from parallel_lab.protocol import FAILED_FILE, METRICS_FILE, PARAMS_FILE, FailedRun, RunMetrics, load_final_params
from parallel_lab.report.parity import (
    EARLY_STEPS,
    ENVELOPE_MULTIPLE,
    FLOOR_ULPS,
    NOISE_SEEDS,
    adam_lr_of,
    envelope,
    gaps,
    judge,
)

MiB = 1024 * 1024
NOISE_HINT = (
    "run the comparison as a sweep that includes strategy=single (python -m parallel_lab -m "
    "strategy=single,...): it reruns the baseline for the noise floor (report/parity.py noise_reruns)"
)


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

    def to_json(self) -> dict:
        """comparison.json: the record's fields, where it lives, and the verdict with its evidence."""
        out = {**self.record.to_json(), "run_dir": self.run_dir, "parity": self.parity}
        if self.parity_checks:
            out.update(
                dloss_per_step=self.dloss_per_step,
                noise_envelope_per_step=self.noise_envelope_per_step,
                parity_checks=self.parity_checks,
            )
        return out


def load_runs(dirs: list[Path]) -> list[Row]:
    runs = []
    for top in dirs:
        runs += [Row(str(path.parent), metrics=RunMetrics.read(path)) for path in sorted(top.rglob(METRICS_FILE))]
        runs += [Row(str(path.parent), failure=FailedRun.read(path)) for path in sorted(top.rglob(FAILED_FILE))]
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
    # norm: a BatchNorm row is judged against single with the same layers (and its own reruns).
    return (m.model, m.global_batch, m.steps, m.data, m.optimizer, m.lr, precision_of(m), m.norm)


def is_baseline(run: Row) -> bool:
    return run.ok and run.metrics.strategy == "single" and not run.is_noise


def _losses_params(run: Row) -> tuple[list[float], dict] | None:
    params = load_final_params(Path(run.run_dir))
    return None if params is None else (run.metrics.losses, params)


def add_parity(runs: list[Row]) -> None:
    """Judge every ok run against the single baseline of the same setup and that baseline's
    noise-floor reruns (report/parity.py): fills each row's parity and parity_checks."""
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
        verdict = judge(gap, env, *base_pair, adam_lr=adam_lr_of(run.metrics.optimizer, run.metrics.lr))
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


def _max_rank(run: Row, key: str) -> int | None:
    values = [r.get(key) for r in (run.metrics.ranks if run.ok else []) if r.get(key) is not None]
    return max(values) if values else None


def _mib(run: Row, key: str) -> float | None:
    value = _max_rank(run, key)
    return None if value is None else value / MiB


def _rank_mib(key: str):
    """MiB of one measured quantity (``ranks[*][key]``) on the rank holding the most."""
    return lambda run: _mib(run, key)


MODEL_STATE = ("param_bytes", "master_param_bytes", "grad_bytes", "optim_bytes")
STATE_KIND = dict(zip(MODEL_STATE, ("params", "master", "grads", "optim")))  # its name in the table


def _state_total(rank: dict, prefix: str = "") -> int | None:
    values = [rank.get(prefix + k) for k in MODEL_STATE]
    return None if all(v is None for v in values) else sum(v or 0 for v in values)


def _state_mib(prefix: str):
    """Model-state MiB (params + master + grads + optim) of the rank holding the most, as measured
    (prefix ""), as the planner predicted it exactly ("predicted_") or by the ZeRO paper ("analytic_")."""

    def read(run: Row) -> float | None:
        ranks = run.metrics.ranks if run.ok else []
        if not ranks:
            return None
        total = _state_total(max(ranks, key=lambda r: _state_total(r) or 0), prefix)
        return None if total is None else total / MiB

    return read


def _relative(predicted: int, measured: int) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return (predicted - measured) / measured


def _plan_error(key: str):
    """The planner's largest relative error over the ranks for one kind of model state, in percent
    (0 where every rank matches to the byte)."""

    def read(run: Row) -> float | None:
        ranks = [r for r in (run.metrics.ranks if run.ok else []) if "predicted_param_bytes" in r]
        if not ranks:
            return None
        return 100 * max((_relative(r[f"predicted_{key}"], r.get(key) or 0) for r in ranks), key=abs)

    return read


CHECKS = {  # parity check (report/parity.py) -> its name in the table
    "early_dloss": "early Δloss",
    "max_dloss": "max Δloss",
    "param_rel_l2": "θ rel L2",
    "param_max_abs": "max |Δθ|",
}


def _check(name: str, part: str):
    """One parity check's divergence ('value') or its ratio to the noise envelope ('ratio')."""
    return lambda run: (run.parity_checks.get(name) or {}).get(part)


def _ok(read):
    """A column only finished runs have: read(metrics), blank for a failed run."""
    return lambda run: read(run.metrics) if run.ok else None


def mark_variants(runs: list[Row]) -> None:
    """Label rows of one strategy by the options they differ in (a sweep over
    strategy.allreduce=ring,builtin,mpi gives three manual_ddp rows: ``manual_ddp allreduce=mpi``)."""
    by_strategy: dict[str, list[Row]] = {}
    for run in runs:
        if run.ok and not run.is_noise:
            by_strategy.setdefault(run.metrics.strategy, []).append(run)
    for rows in by_strategy.values():
        keys = sorted({k for r in rows for k in r.metrics.strategy_options if k != "name"})
        varying = [k for k in keys if len({repr(r.metrics.strategy_options.get(k)) for r in rows}) > 1]
        for run in rows:
            run.variant = " ".join(f"{k}={run.metrics.strategy_options.get(k)}" for k in varying)


def _strategy_label(run: Row) -> str:
    if run.is_noise:
        m = run.metrics
        return f"{m.strategy} (noise: {m.noise_rerun or f'ulp_jitter_seed={m.ulp_jitter_seed}'})"
    return " ".join(filter(None, (run.record.strategy, run.variant)))


def _norm(m: RunMetrics) -> str:
    """'batch (32)': model.norm and the samples each BatchNorm forward normalised over; a '≠' marks
    running statistics that ended different across replicas."""
    bn = m.batchnorm or {}
    samples = "/".join(map(str, bn.get("samples", [])))
    mark = "" if bn.get("running_stats_identical", True) else " ≠replicas"
    return f"{m.norm} ({samples}){mark}" if samples else m.norm


def _bn_comm(key: str):
    """Bytes per step BatchNorm added (SyncBatchNorm's collectives, or the running statistics'
    broadcast), measured on its own group or in theory (strategies/batchnorm.py); None without."""

    def read(m: RunMetrics) -> float | None:
        return (m.batchnorm or {}).get(key)

    return read


def _md_strategy(run: Row) -> str:
    """The strategy cell of comparison.md: the label, and the norm where it is not GroupNorm
    ('ddp [batch (16)]'), so a BatchNorm row reads as what it is without a column of its own."""
    label = _strategy_label(run)
    m = run.metrics
    return f"{label} [{_norm(m)}]" if run.ok and m.norm not in (None, "group") else label


def _mesh(m: RunMetrics) -> str | None:
    """'replicate 2 × shard 2': the 2-D device mesh of the run (strategies/mesh.py), blank for a flat world."""
    mesh = m.strategy_extras.get("mesh")
    return mesh and " × ".join(f"{name} {size}" for name, size in mesh["dims"].items())


def _mesh_comm(m: RunMetrics) -> str | None:
    """MiB per step on each mesh dimension's group (busiest rank): on several hosts, replicate is
    the traffic between them, the other dimension stays inside one."""
    mesh = m.strategy_extras.get("mesh")
    return mesh and " / ".join(f"{name} {n / MiB}" for name, n in mesh["comm_bytes_per_step"].items())


def _inter_host_mib(m: RunMetrics) -> float | None:
    """The busiest rank's MiB per step on groups spanning hosts (comm/placement.py: the approximation)."""
    return None if m.inter_host_bytes_per_step is None else m.inter_host_bytes_per_step / MiB


TIME_PARTS = ("step", "compute", "comm", "exposed_comm", "optimizer", "idle", "other")  # ranks[k].time_ms


def rank_mean_time_ms(m: RunMetrics) -> dict[str, float] | None:
    """trainer.profile runs: the mean over ranks of each rank's mean profiled step (ms; the parts
    still add up to the step), None for a run that was not profiled."""
    per_rank = [r["time_ms"] for r in m.ranks if r.get("time_ms")]
    if not per_rank:
        return None
    return {key: sum(t[key] for t in per_rank) / len(per_rank) for key in TIME_PARTS}


def _overlap_pct(t: dict[str, float]) -> float | None:
    return 100 * (1 - t["exposed_comm"] / t["comm"]) if t["comm"] else None


def _exposed_comm(m: RunMetrics) -> str | None:
    """'exposed / total comm ms (overlap %)' of the profiled steps (worker/timeline.py)."""
    t = rank_mean_time_ms(m)
    if t is None:
        return None
    overlap = _overlap_pct(t)
    return f"{_num(t['exposed_comm'])} / {_num(t['comm'])}" + ("" if overlap is None else f" ({_num(overlap)}%)")


def _time_part(key: str):
    def read(m: RunMetrics) -> float | None:
        t = rank_mean_time_ms(m)
        return None if t is None else t[key]

    return read


# comparison.csv only (the md table stays narrow): where the profiled step's time went, rank mean
PROFILE_COLUMNS = [
    *((f"{key.replace('_', ' ')} ms (trace)", _ok(_time_part(key))) for key in TIME_PARTS),
    ("overlap %", _ok(lambda m: None if rank_mean_time_ms(m) is None else _overlap_pct(rank_mean_time_ms(m)))),
]


def _theory_psi(m: RunMetrics) -> float | None:
    """The ZeRO paper's Ψ per step (a float even where json stored 2: one number format in md)."""
    return None if m.comm_theory_psi is None else float(m.comm_theory_psi)


_CUDA_ALLOC, _CUDA_RESERVED = _rank_mib("cuda_max_allocated_bytes"), _rank_mib("cuda_max_reserved_bytes")
_STATE = {"measured": _state_mib(""), "plan": _state_mib("predicted_"), "paper": _state_mib("analytic_")}

# comparison.csv: every column, one value per cell, as measured (no rounding).
COLUMNS = [  # (header, how to read it from a row)
    ("strategy", _strategy_label),
    ("launcher", lambda r: r.record.launcher),
    ("world", lambda r: r.record.world_size),
    ("nodes", _ok(lambda m: m.nodes)),
    ("procs per node", _ok(lambda m: m.nproc_per_node)),
    ("model", lambda r: r.record.model),
    ("params", _ok(lambda m: m.params)),
    ("samples/s", _ok(lambda m: m.samples_per_s)),
    ("step ms", _ok(lambda m: 1000 * m.step_time_s)),
    ("fwd+bwd ms", _ok(lambda m: 1000 * m.step_split_s["fwd_bwd"])),
    ("opt ms", _ok(lambda m: 1000 * m.step_split_s["optimizer"])),
    ("peak RSS MiB", _rank_mib("peak_rss_bytes")),
    ("CUDA alloc MiB", _CUDA_ALLOC),
    ("CUDA reserved MiB", _CUDA_RESERVED),
    *(
        (f"{kind} MiB {source}", _rank_mib(prefix + key))
        for key, kind in STATE_KIND.items()
        for source, prefix in (("measured", ""), ("analytic", "analytic_"))
    ),
    *((f"model state MiB {source}", read) for source, read in _STATE.items()),
    *((f"plan error % {kind}", _plan_error(key)) for key, kind in STATE_KIND.items()),
    ("comm MiB/step", _ok(lambda m: m.comm_bytes_per_step / MiB)),
    ("comm Ψ measured", _ok(lambda m: m.comm_volume_psi)),
    ("comm Ψ theory", _ok(_theory_psi)),
    ("mesh", _ok(_mesh)),
    ("comm MiB/step per mesh dim", _ok(_mesh_comm)),
    ("inter-host MiB/step", _ok(_inter_host_mib)),
    ("norm (samples)", _ok(_norm)),
    ("BN comm B/step measured", _ok(_bn_comm("comm_bytes_per_step"))),
    ("BN comm B/step theory", _ok(_bn_comm("comm_theory_bytes_per_step"))),
    ("final loss", _ok(lambda m: m.final_loss)),
    *(
        (f"{label}{suffix}", _check(name, part))
        for name, label in CHECKS.items()
        for suffix, part in (("", "value"), (" ×env", "ratio"))
    ),
    *PROFILE_COLUMNS,
    ("parity", lambda r: r.parity),
    ("error", lambda r: r.failure.error if r.failure else None),
]


READ = {header: read for header, read in COLUMNS}
DIGITS = 4  # significant digits of every number in comparison.md


def _num(value: float) -> str:
    """comparison.md's one rule for a number: DIGITS significant digits with trailing zeros kept (each
    number shows its precision), thousands grouped and whole digits never rounded away; 0 is 0."""
    if value == 0:
        return "0"
    text = f"{value:#.{DIGITS}g}"
    if isinstance(value, int) or "e+" in text or text.endswith("."):  # a count, or 1000 and above
        return f"{value:,.0f}"
    return text


def _cell(value) -> str:
    if value is None:
        return ""
    return _num(value) if isinstance(value, (int, float)) else str(value)


def _joined(*reads):
    """'a / b / c': numbers to compare in one cell; '?' for a missing one, blank when the first is."""

    def read(run: Row) -> str | None:
        values = [r(run) for r in reads]
        return None if values[0] is None else " / ".join("?" if v is None else _num(v) for v in values)

    return read


def _world_cell(run: Row) -> str:
    """'4 (2×2)': the world size and how the launcher placed it, nodes × processes per node."""
    m = run.metrics
    placed = f" ({m.nodes}×{m.nproc_per_node})" if run.ok and m.nodes else ""
    return f"{run.record.world_size}{placed}{_world_changes(m) if run.ok else ''}"


def _world_changes(m: RunMetrics) -> str:
    """' [2→1 at step 20]': where an elastic run (or a reshard) changed its world or strategy."""
    ranges = getattr(m, "world_size_history", None) or []
    changes = [
        f"{a['world_size']}→{b['world_size']}"
        + (f" {a['strategy']}→{b['strategy']}" if a["strategy"] != b["strategy"] else "")
        + f" at step {b['from_step']}"
        for a, b in zip(ranges, ranges[1:])
    ]
    return f" [{'; '.join(changes)}]" if changes else ""


def _mesh_cell(m: RunMetrics) -> str | None:
    """'replicate 2 (1.226) × shard 2 (3.677)': the mesh and each dimension's MiB per step."""
    mesh = m.strategy_extras.get("mesh")
    per_dim = mesh and mesh["comm_bytes_per_step"]
    return mesh and " × ".join(f"{name} {size} ({_num(per_dim[name] / MiB)})" for name, size in mesh["dims"].items())


def _evidence(run: Row) -> str | None:
    """What the parity cell rests on: the check nearest its bound as 'name divergence (ratio to the
    noise envelope ×)', or a failed run's error."""
    if run.failure:
        return run.failure.error
    checks = [(label, run.parity_checks[name]) for name, label in CHECKS.items() if name in run.parity_checks]
    if not checks:
        return None
    label, check = max(checks, key=lambda c: c[1]["ratio"])
    return f"{label} {_num(check['value'])} ({_num(check['ratio'])}×)"


# comparison.md: what a reader compares, at most 14 columns; a column with a `shown` test appears
# only when some row passes it (CUDA memory: a GPU ran; the mesh; the hosts: more than one).
MD_COLUMNS = [  # (header, how to read it from a row, shown)
    ("strategy", _md_strategy, None),
    ("launcher", READ["launcher"], None),
    ("world (nodes×procs)", _world_cell, None),
    ("mesh (comm MiB/step per dim)", _ok(_mesh_cell), READ["mesh"]),
    ("samples/s", READ["samples/s"], None),
    ("step ms", READ["step ms"], None),
    ("peak RSS MiB", READ["peak RSS MiB"], None),
    ("CUDA alloc/reserved MiB", _joined(_CUDA_ALLOC, _CUDA_RESERVED), lambda r: _CUDA_ALLOC(r) is not None),
    ("model state MiB meas/plan/paper", _joined(*_STATE.values()), None),
    ("comm Ψ meas/theory", _joined(READ["comm Ψ measured"], READ["comm Ψ theory"]), None),
    ("inter-host MiB/step", READ["inter-host MiB/step"], lambda r: r.ok and (r.metrics.nodes or 1) > 1),
    ("exposed / comm ms (overlap)", _ok(_exposed_comm), lambda r: r.ok and rank_mean_time_ms(r.metrics) is not None),
    ("parity", READ["parity"], None),
    ("evidence", _evidence, None),
]


def md_columns(runs: list[Row]) -> list[tuple]:
    """MD_COLUMNS without the conditional ones no row calls for."""
    return [c for c in MD_COLUMNS if c[2] is None or any(c[2](run) for run in runs)]


def csv_rows(runs: list[Row]) -> list[list]:
    """Every column of every row, the values as read (comparison.csv)."""
    mark_variants(runs)
    return [[get(run) for _, get in COLUMNS] for run in runs]


def criterion_line(runs: list[Row]) -> str:
    """How parity was judged, and on which CPU kernels and GPUs (the floats depend on them)."""
    cpus = sorted(
        {
            " ".join([r.metrics.cpu_capability, *(f"{k}={v}" for k, v in r.metrics.kernel_dispatch.items())])
            for r in runs
            if r.ok and r.metrics.cpu_capability
        }
    )
    gpus = sorted({r.metrics.device_name for r in runs if r.ok and r.metrics.device_name})
    return (
        f"Parity: each row vs `single`, against the noise envelope of `single` rerun with the same training in "
        f"other last bits (weights moved 1 ulp, seeds {', '.join(map(str, NOISE_SEEDS))}; gradients moved by their "
        f"rounding; more micro-batches; another thread count). Pass = every ratio ≤ {ENVELOPE_MULTIPLE:g}× "
        f"(Δloss at each of the first {EARLY_STEPS} steps and over the run, final parameters' relative L2 and "
        f"max |Δθ|; "
        f"floor {FLOOR_ULPS} float32 ulps, under Adam one weight moved 2·lr·steps; bf16 rows against `single` "
        f"in bf16 and its own reruns). "
        f"CPU kernels: {', '.join(cpus) or 'unknown'}."
        + (f" GPU: {', '.join(gpus)}." if gpus else "")
        + (f" No noise floor here: {NOISE_HINT}." if any(r.parity == "no noise floor" for r in runs) else "")
    )


def markdown(runs: list[Row]) -> str:
    escape = lambda text: text.replace("|", "\\|")  # noqa: E731  ("max |Δθ|" must not split its column)
    mark_variants(runs)
    columns = md_columns(runs)
    lines = ["| " + " | ".join(escape(h) for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(escape(_cell(read(run))) for _, read, _ in columns) + " |" for run in runs]
    return "\n".join(lines) + "\n\n" + criterion_line(runs) + "\n"


def write_tables(runs: list[Row], out: Path) -> str:
    """comparison.md, .csv and .json in out (the parity of every row judged first); returns the md."""
    add_parity(runs)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(runs)
    (out / "comparison.md").write_text(text)
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([h for h, _ in COLUMNS])
        writer.writerows(csv_rows(runs))
    (out / "comparison.json").write_text(json.dumps([run.to_json() for run in runs], indent=2) + "\n")
    return text


def summary_line(metrics_path: Path) -> str:
    m = RunMetrics.read(metrics_path)
    return (
        f"{m.strategy} x{m.world_size} ({m.launcher}, {m.backend}, {m.device}): "
        f"final loss {m.final_loss:.4f}, {m.samples_per_s:.0f} samples/s, "
        f"checksum {m.final_param_checksum:.6f} -> {Path(metrics_path).parent}"
    )
