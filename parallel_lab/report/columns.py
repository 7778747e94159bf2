"""comparison.csv's columns: how each number is read from a row (``COLUMNS``, one value per cell,
unrounded), and the readers comparison.md shares with it (``READ``, the model state, the mesh, the
profiled time). The rows and their parity: ``rows.py``; the md table and the files: ``table.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from parallel_lab.protocol import CONFIG_FILE, RunMetrics
from parallel_lab.report import timing
from parallel_lab.report.rows import Row

MiB = 1024 * 1024


def max_rank(run: Row, key: str) -> int | None:
    values = [r.get(key) for r in (run.metrics.ranks if run.ok else []) if r.get(key) is not None]
    return max(values) if values else None


def _mib(run: Row, key: str) -> float | None:
    value = max_rank(run, key)
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


def finished_only(read):
    """A column only finished runs have: read(metrics), blank for a failed run."""
    return lambda run: read(run.metrics) if run.ok else None


def mark_variants(runs: list[Row]) -> None:
    """Label each row by its strategy options that are not at their default (a sweep over
    strategy.allreduce=ring,builtin,mpi gives ``manual_ddp``, ``manual_ddp allreduce=builtin`` and
    ``manual_ddp allreduce=mpi``; ring is the default), a lone row too (``pp impl=deepspeed``, not
    ``pp``). Distinct options still give distinct labels: two rows that differ in an option show it
    on the row (or rows) not at its default. A strategy whose defaults this install cannot read
    (a plugin missing) shows the options its rows differ in."""
    by_strategy: dict[str, list[Row]] = {}
    for run in runs:
        if run.ok and not run.is_noise:
            by_strategy.setdefault(run.metrics.strategy, []).append(run)
    for strategy, rows in by_strategy.items():
        keys = sorted({k for r in rows for k in r.metrics.strategy_options if k != "name"})
        defaults = option_defaults(strategy)
        varying = [k for k in keys if len({repr(r.metrics.strategy_options.get(k)) for r in rows}) > 1]
        varying = [k for k in keys if k in defaults] if defaults else varying
        moe = len({r.metrics.moe_experts for r in rows}) > 1  # MoE rows beside dense ones (compare_vit)
        for run in rows:
            experts = f"moe_experts={run.metrics.moe_experts}" if moe and run.metrics.moe_experts else ""
            options = run.metrics.strategy_options
            shown = [f"{k}={options.get(k)}" for k in varying if k not in defaults or defaults[k] != options.get(k)]
            run.variant = " ".join(filter(None, [experts, *shown]))


def option_defaults(strategy: str) -> dict[str, object]:
    """strategy.<key> -> its default, as metrics.json's ``strategy_options`` holds values (a choice
    by its value), from the strategy's Options dataclass; {} for a strategy this install lacks."""
    import dataclasses

    from parallel_lab.errors import ConfigError
    from parallel_lab.strategies import get_strategy_rules

    try:
        options = get_strategy_rules(strategy).Options
    except ConfigError:
        return {}
    fields = (f for f in dataclasses.fields(options) if f.default is not dataclasses.MISSING)
    return {f.name: getattr(f.default, "value", f.default) for f in fields}


def strategy_label(run: Row) -> str:
    if run.is_noise:
        m = run.metrics
        return f"{m.strategy} (noise: {m.noise_rerun or f'ulp_jitter_seed={m.ulp_jitter_seed}'})"
    return " ".join(filter(None, (run.record.strategy, run.variant)))


def norm_cell(m: RunMetrics) -> str:
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


def overlap_pct(t: dict[str, float]) -> float | None:
    return 100 * (1 - t["exposed_comm"] / t["comm"]) if t["comm"] else None


def _time_part(key: str):
    def read(m: RunMetrics) -> float | None:
        t = rank_mean_time_ms(m)
        return None if t is None else t[key]

    return read


# comparison.csv only (the md table stays narrow): where the profiled step's time went, rank mean
PROFILE_COLUMNS = [
    *((f"{key.replace('_', ' ')} ms (trace)", finished_only(_time_part(key))) for key in TIME_PARTS),
    ("overlap %", finished_only(lambda m: None if rank_mean_time_ms(m) is None else overlap_pct(rank_mean_time_ms(m)))),
]


def _theory_psi(run: Row) -> float | None:
    """Ψ per step in theory (a float even where json stored 2: one number format in md): the ZeRO
    paper's formula where the strategy has one (metrics.json's comm_theory_psi), else the planner's
    formula for rank 0's bytes, the rank the run counted (metrics.json's comm_planned_psi, which
    rank 0 computed where its torch was loaded anyway; ``_planned_psi`` for older runs)."""
    m = run.metrics
    if m.comm_theory_psi is not None:
        return float(m.comm_theory_psi)
    return m.comm_planned_psi if m.comm_planned_psi is not None else _planned_psi(run.run_dir, m.params)


@functools.cache
def _planned_psi(run_dir: str, params: int) -> float | None:
    """``plan.predict.planned_comm_psi`` for the run's config.yaml, for a metrics.json written
    before ranks stored it (``comm_planned_psi``). None without config.yaml or a prediction."""
    config = Path(run_dir) / CONFIG_FILE
    if not config.is_file():
        return None
    from omegaconf import OmegaConf

    from parallel_lab.errors import ConfigError
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import planned_comm_psi
    from parallel_lab.strategies import get_strategy_class

    cfg = OmegaConf.load(config)
    try:  # a run of a plugin strategy this process did not load, or of a model it does not know
        strategy_cls, model = get_strategy_class(cfg.strategy.name), build_meta_model(cfg.model)
    except ConfigError:
        return None
    return planned_comm_psi(cfg, strategy_cls, model, params)


CUDA_ALLOC, CUDA_RESERVED = _rank_mib("cuda_max_allocated_bytes"), _rank_mib("cuda_max_reserved_bytes")
MODEL_STATE_MIB = {"measured": _state_mib(""), "plan": _state_mib("predicted_"), "paper": _state_mib("analytic_")}


def _interval(name: str, part: str):
    """One timing interval's median, low or high end (report/timing.py); blank where there is none."""

    def read(run: Row) -> float | None:
        interval = timing.interval(run, name)
        return None if interval is None else getattr(interval, part)

    return read


# The time figures: the median (over rounds, or the run's steps) and its 95% interval's ends.
TIME_COLUMNS = [
    ("samples/s", _interval("samples_per_s", "median")),
    ("samples/s ci95 low", _interval("samples_per_s", "low")),
    ("samples/s ci95 high", _interval("samples_per_s", "high")),
    ("step ms", _interval("step_ms", "median")),
    ("step ms ci95 low", _interval("step_ms", "low")),
    ("step ms ci95 high", _interval("step_ms", "high")),
    ("time samples", _interval("step_ms", "n")),
    ("time samples over", _interval("step_ms", "over")),
    ("vs single", lambda r: r.vs_baseline or None),
    ("model GFLOP/step", finished_only(lambda m: m.model_flops_per_step and m.model_flops_per_step / 1e9)),
    ("GFLOP/s per rank", lambda r: r.gflops_per_rank),
    ("peak GFLOP/s", lambda r: r.peak and r.peak["peak_gflops"]),
    ("MFU", timing.mfu),
    ("load avg start", finished_only(lambda m: (m.machine.get("start") or {}).get("loadavg", [None])[0])),
    ("load avg end", finished_only(lambda m: (m.machine.get("end") or {}).get("loadavg", [None])[0])),
]
PROFILE_INTERVALS = [  # the profiled parts' medians and intervals (the means above add up to the step)
    (f"{key.replace('_', ' ')} ms median{suffix}", _interval(key, part))
    for key in timing.PROFILE_PARTS
    for suffix, part in (("", "median"), (" ci95 low", "low"), (" ci95 high", "high"))
]

# comparison.csv: every column, one value per cell, as measured (no rounding).
COLUMNS = [  # (header, how to read it from a row)
    ("strategy", strategy_label),
    ("launcher", lambda r: r.record.launcher),
    ("world", lambda r: r.record.world_size),
    ("nodes", finished_only(lambda m: m.nodes)),
    ("procs per node", finished_only(lambda m: m.nproc_per_node)),
    ("model", lambda r: r.record.model),
    ("params", finished_only(lambda m: m.params)),
    *TIME_COLUMNS,
    ("fwd+bwd ms", finished_only(lambda m: 1000 * m.step_split_s["fwd_bwd"])),
    ("opt ms", finished_only(lambda m: 1000 * m.step_split_s["optimizer"])),
    ("peak RSS MiB", _rank_mib("peak_rss_bytes")),
    ("CUDA alloc MiB", CUDA_ALLOC),
    ("CUDA reserved MiB", CUDA_RESERVED),
    *(
        (f"{kind} MiB {source}", _rank_mib(prefix + key))
        for key, kind in STATE_KIND.items()
        for source, prefix in (("measured", ""), ("analytic", "analytic_"))
    ),
    *((f"model state MiB {source}", read) for source, read in MODEL_STATE_MIB.items()),
    *((f"plan error % {kind}", _plan_error(key)) for key, kind in STATE_KIND.items()),
    ("comm MiB/step", finished_only(lambda m: m.comm_bytes_per_step / MiB)),
    ("comm Ψ measured", finished_only(lambda m: m.comm_volume_psi)),
    ("comm Ψ theory", lambda run: _theory_psi(run) if run.ok else None),
    ("mesh", finished_only(_mesh)),
    ("comm MiB/step per mesh dim", finished_only(_mesh_comm)),
    ("inter-host MiB/step", finished_only(_inter_host_mib)),
    ("norm (samples)", finished_only(norm_cell)),
    ("BN comm B/step measured", finished_only(_bn_comm("comm_bytes_per_step"))),
    ("BN comm B/step theory", finished_only(_bn_comm("comm_theory_bytes_per_step"))),
    ("final loss", finished_only(lambda m: m.final_loss)),
    *(
        (f"{label}{suffix}", _check(name, part))
        for name, label in CHECKS.items()
        for suffix, part in (("", "value"), (" ×env", "ratio"))
    ),
    *PROFILE_COLUMNS,
    *PROFILE_INTERVALS,
    # The replica check (report/parity.py Replicas): True, False (the run fails), None (no two ranks hold one)
    ("replicas agree", finished_only(lambda m: m.replica_digests_agree)),
    ("parity", lambda r: r.parity),
    ("error", lambda r: r.failure.error if r.failure else None),
]


READ = {header: read for header, read in COLUMNS}
