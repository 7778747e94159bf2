"""``python -m parallel_lab.bench published [--csv FILE]``: the cluster planner (parallel_lab/plan/
cluster) against published large-scale runs, each row citing its source (paper, table, row).

The table (``published_runs.csv`` beside this file): Narayanan et al. 2021 (arXiv 2104.04473) Table
1 and Table 2 (ZeRO-3 vs PTD-P), Korthikanti et al. 2022 (arXiv 2205.05198) full vs selective
recomputation, Llama 3 (arXiv 2407.21783) Table 4 (its context-parallel row too: held out),
torchtitan's Llama 3 8B FSDP rows. Left out, with the reason printed: torchtitan's CP rows (they
run torch.compile or Float8), torchtitan's torch.compile and Float8 rows (fused kernels and an FP8
peak the model does not price). Korthikanti's per-GPU memory is a figure without numbers: left out.

The GEMM ceiling per GPU kind, the shared half-dimension and the caching allocator's reserve
(measured reserved memory over the predicted allocation) are fitted on the rows named FITTED (at most
a third); every other row is held out. A measured TFLOP/s becomes an iteration time through
the row's own FLOP count (arXiv 2104.04473 eq. 3 with recomputation counted as the paper does).

``--csv FILE`` runs the same check on your table, columns exactly: name, hardware, gpus,
gpus_per_node, layers, hidden, heads, kv_heads, seq, vocab, global_batch, micro_batch, tp, pp, dp,
virtual_stages, sequence_parallel, recompute, zero_stage, fsdp, precision, measured_iteration_s,
measured_tflops_per_gpu, measured_memory_gib (an empty cell: unknown or the default; hardware a
profile name with overrides, ``a100_80g;inter_node_gbps=800``; recompute none, selective, full or
selective_op, torchtitan's per-operator policy; optional ``cp`` and ``cp_impl``: context parallelism,
``ring`` or ``ulysses``). With --csv nothing is fitted.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

from parallel_lab.plan.cluster import context
from parallel_lab.plan.cluster.hardware import Hardware, from_spec
from parallel_lab.plan.cluster.layout import describe
from parallel_lab.plan.cluster.recommend import Candidate, rank
from parallel_lab.plan.cluster.shape import ModelShape
from parallel_lab.plan.cluster.steptime import ClusterRun, predict
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.strategies.planning import ClusterLayout

TABLE = Path(__file__).with_name("published_runs.csv")
COLUMNS = (
    "name hardware gpus gpus_per_node layers hidden heads kv_heads seq vocab global_batch micro_batch tp pp dp "
    "virtual_stages sequence_parallel recompute zero_stage fsdp precision measured_iteration_s "
    "measured_tflops_per_gpu measured_memory_gib"
).split()
# optional columns: Llama's MLP, FlashAttention, context parallelism (cp x the others = gpus)
OPTIONAL = ("ffn", "gated", "fused_attention", "cp", "cp_impl", "source")
FITTED = (
    "narayanan_t1_1.7B",
    "narayanan_t1_18.4B",
    "narayanan_t1_145.6B",
    "narayanan_t1_1008.0B",
    "korthikanti_175B_full",
    "narayanan_t2_zero3_174.6B_384",
    "torchtitan_llama3_8b_fsdp_8",
)
LEFT_OUT = (
    "torchtitan Tables 1, 3 torch.compile and Float8 rows, Tables 2, 4, 5, 6 (their CP rows among them, each with "
    "torch.compile or Float8): compile's fused kernels, Float8's FP8 peak and AsyncTP are not modelled",
    "Korthikanti et al. per-GPU memory: published as a figure, no numbers to compare",
)
OVERLAPPED = frozenset({"all_gather", "reduce_scatter", "all_reduce"})


def read_rows(path: Path) -> list[SimpleNamespace]:
    """The table's rows; a missing or unknown column is one line."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in COLUMNS if c not in header]
        unknown = [c for c in header if c not in COLUMNS and c not in OPTIONAL]
        if missing or unknown:
            raise SystemExit(
                f"{path}: columns {missing or unknown} {'missing' if missing else 'unknown'}; "
                f"use exactly: {', '.join(COLUMNS)}"
            )
        return [SimpleNamespace(**{c: row.get(c, "") or "" for c in (*COLUMNS, *OPTIONAL)}) for row in reader]


def _int(text: str, default: int) -> int:
    return int(float(text)) if text else default


def shape_of(row) -> ModelShape:
    hidden, heads = int(row.layers and row.hidden), int(row.heads)
    gated = row.gated.lower() == "true"
    return ModelShape(
        layers=int(row.layers),
        hidden=hidden,
        heads=heads,
        kv_heads=_int(row.kv_heads, heads),
        ffn=_int(row.ffn, 4 * hidden),
        seq=int(row.seq),
        vocab=int(row.vocab),
        gated=gated,
        tied=not gated,
        name=row.name,
        rotary=gated,
        fused_attention=row.fused_attention.lower() == "true",
    )


def run_of(row, hw: Hardware) -> ClusterRun:
    """The row as a ClusterRun: ZeRO's stage (or FSDP's full/hybrid) over the data-parallel ranks."""
    gpus, tp, pp, cp = int(row.gpus), _int(row.tp, 1), _int(row.pp, 1), _int(row.cp, 1)
    dp = _int(row.dp, gpus // (tp * pp * cp))
    stage = 3 if row.fsdp in ("full", "hybrid") else _int(row.zero_stage, 0)
    ways = dp if row.fsdp != "hybrid" else max(1, hw.gpus_per_node // (tp * pp))
    ways = ways if stage else 1
    virtual = _int(row.virtual_stages, 1)
    micro = _int(row.micro_batch, 1)
    schedule = ("interleaved_1f1b" if virtual > 1 else "1f1b") if pp > 1 else None
    layout = ClusterLayout(
        dims=MeshDims(replicate=dp // ways, shard=ways, cp=cp, pp=pp, tp=tp),
        shard_stage=stage,
        shard_ways=ways,
        schedule=schedule,
        virtual_stages=virtual,
        microbatches=max(1, int(row.global_batch) // (dp * micro)),
        sequence_parallel=row.sequence_parallel.lower() == "true",
        overlapped=OVERLAPPED if stage >= 3 else frozenset(),
        regathers_on_recompute=stage >= 3 and row.fsdp not in ("full", "hybrid"),  # DeepSpeed's ZeRO-3
    )
    if layout.dims.world != gpus:
        raise SystemExit(
            f"{row.name}: dp {dp} x cp {cp} x pp {pp} x tp {tp} = {layout.dims.world} is not gpus={gpus}; "
            "fix one of them (an empty dp is gpus / (cp x pp x tp))"
        )
    shape = shape_of(row)
    context.check(shape, cp, row.cp_impl or "ring", tp)
    precision, recompute = row.precision or "bf16", row.recompute or "none"
    return ClusterRun(shape, hw, layout, int(row.global_batch), precision, recompute, cp_impl=row.cp_impl or "ring")


def measured_iteration(row, shape: ModelShape) -> float | None:
    if row.measured_iteration_s:
        return float(row.measured_iteration_s)
    if row.measured_tflops_per_gpu:
        flops = shape.flops_per_token(row.recompute or "none") * int(row.global_batch) * shape.seq
        return flops / (int(row.gpus) * float(row.measured_tflops_per_gpu) * 1e12)
    return None


def hardware_of(row, fit: dict) -> Hardware:
    hw = dataclasses.replace(
        from_spec(row.hardware), gpus_per_node=_int(row.gpus_per_node, from_spec(row.hardware).gpus_per_node)
    )
    return dataclasses.replace(
        hw,
        gemm_efficiency=fit.get(row.hardware, hw.gemm_efficiency),
        gemm_half_dim=fit.get("half", hw.gemm_half_dim),
        allocator_slack=fit.get("allocator", hw.allocator_slack),
    )


def log_error(row, fit: dict) -> float:
    run = run_of(row, hardware_of(row, fit))
    return math.log(predict(run).step_time_s / measured_iteration(row, run.shape))


def fit_rows(rows: list) -> dict:
    """The GEMM ceiling per hardware (each profile with its overrides: torchtitan's 500 W HBM2e
    H100s are not Llama 3's) and the shared half-dimension, minimising the
    fitted rows' squared log error (a grid over the half-dimension, each kind's ceiling in closed form
    per point: the median log error brought to zero by a few fixed-point steps)."""
    best = None
    for half in (16, 32, 64, 96, 128, 192, 256):
        fit = {"half": float(half)}
        for kind in sorted({r.hardware for r in rows}):
            mine = [r for r in rows if r.hardware == kind]
            eff = 0.8
            for _ in range(6):
                fit[kind] = eff
                eff = min(1.0, eff * math.exp(statistics.median(log_error(r, fit) for r in mine)))
            fit[kind] = eff
        loss = sum(log_error(r, fit) ** 2 for r in rows)
        if best is None or loss < best[0]:
            best = (loss, fit)
    return {**best[1], "allocator": allocator_slack(rows, best[1])}


def allocator_slack(rows: list, fit: dict) -> float:
    """The caching allocator's reserve over the bytes the model holds at the peak: the median of
    the fitted rows' measured (reserved) memory over the predicted allocation, less one."""
    ratios = []
    for row in [r for r in rows if r.measured_memory_gib]:
        run = run_of(row, hardware_of(row, {**fit, "allocator": 0.0}))
        ratios.append(float(row.measured_memory_gib) * 2**30 / predict(run).memory_bytes_per_gpu)
    return max(0.0, statistics.median(ratios) - 1) if ratios else 0.0


@dataclasses.dataclass(frozen=True)
class PickRow:
    """One Narayanan Table 1 row against the recommender: the published layout's predicted step,
    our top pick (which fits memory) and our best among the techniques the source ran."""

    name: str
    published: ClusterRun
    published_s: float
    pick: Candidate | None
    own: tuple[ClusterRun, float] | None  # the source's recompute, no sequence parallelism

    @property
    def within(self) -> bool:
        return self.pick is not None and self.published_s <= 1.1 * self.pick.prediction.step_time_s

    @property
    def within_own(self) -> bool:
        return self.own is not None and self.published_s <= 1.1 * self.own[1]


def top_picks(rows: list, fit: dict) -> list[PickRow]:
    """Each Narayanan Table 1 row's published layout beside the recommender's top pick among every
    layout that fits (any recompute, sequence parallelism where tp > 1), and beside its best among
    the techniques the source ran (its own recompute, no sequence parallelism: both came with
    Korthikanti et al. 2022, arXiv 2205.05198, after Table 1)."""
    out = []
    for row in [r for r in rows if r.name.startswith("narayanan_t1_")]:
        hw = hardware_of(row, fit)
        run = run_of(row, hw)
        ranked = rank(run.shape, hw, run.gpus, run.global_batch, run.precision)
        own = [c.run for c in ranked if c.run.recompute == run.recompute]
        plain = [dataclasses.replace(r, layout=dataclasses.replace(r.layout, sequence_parallel=False)) for r in own]
        priced = zip(plain, map(predict, plain))
        fits = [(r, p.step_time_s) for r, p in priced if p.memory_bytes_per_gpu <= hw.hbm_bytes]
        best_own = min(fits, key=lambda pair: pair[1], default=None)
        pick = next((c for c in ranked if c.fits), None)
        out.append(PickRow(row.name, run, predict(run).step_time_s, pick, best_own))
    return out


def print_picks(picks: list[PickRow]) -> None:
    """The published layout, our top pick and what separates them, one line each."""
    print(
        "top pick per Narayanan Table 1 row (published layout: predicted s | our pick | ours, the source's techniques)"
    )
    for row in picks:
        pub = f"{describe(row.published)}, mb {row.published.micro_batch}, {row.published.recompute}"
        line = f"  {row.name}: {pub}: {row.published_s:.2f} s"
        if row.pick is not None:
            c = row.pick
            line += (
                f" | {describe(c.run)}, mb {c.prediction.micro_batch}, {c.run.recompute}: "
                f"{c.prediction.step_time_s:.2f} s ({row.published_s / c.prediction.step_time_s:.2f}x), "
                f"{c.prediction.memory_bytes_per_gpu / 2**30:.1f} GiB"
            )
        if row.own is not None:
            run, seconds = row.own
            line += f" | {describe(run)}, mb {run.micro_batch}: {seconds:.2f} s"
        print(line)


def report(rows: list, fit: dict, fitted: set[str]) -> tuple[list[float], list[tuple[float, str]], list[float]]:
    print(
        f"{'row':<34} {'GPUs':>6} {'measured s':>11} {'predicted s':>12} {'error':>7} {'mem meas/pred GiB':>18}  role"
    )
    errors, worst, mem = [], [], []
    for row in rows:
        run = run_of(row, hardware_of(row, fit))
        pred = predict(run)
        meas = measured_iteration(row, run.shape)
        err = pred.step_time_s / meas - 1 if meas else float("nan")
        memory = ""
        if row.measured_memory_gib:
            got = pred.memory_bytes_per_gpu / 2**30
            memory = f"{float(row.measured_memory_gib):.1f}/{got:.1f}"
            if row.name not in fitted:
                mem.append(abs(got / float(row.measured_memory_gib) - 1))
        role = "fitted" if row.name in fitted else "held-out"
        print(
            f"{row.name:<34} {run.gpus:>6} {meas:>11.3f} {pred.step_time_s:>12.3f} {100 * err:>6.1f}% "
            f"{memory:>18}  {role}"
        )
        if row.name not in fitted and meas:
            errors.append(abs(err))
            worst.append((abs(err), row.name))
    return errors, worst, mem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench published", description=__doc__.split("\n")[0])
    parser.add_argument("--csv", type=Path, help="your own table of runs (columns as documented); nothing is fitted")
    args = parser.parse_args(argv)
    rows = read_rows(args.csv or TABLE)
    fitted = set() if args.csv else set(FITTED)
    fit = fit_rows([r for r in rows if r.name in fitted]) if fitted else {}
    if not args.csv:
        for row in rows:
            print(f"source: {row.name}: {row.source}")
        print("left out: " + "; ".join(LEFT_OUT))
        print(
            f"fitted on {len(fitted)} of {len(rows)} rows ({', '.join(FITTED)}): "
            + ", ".join(f"{k} {v:.3g}" for k, v in fit.items())
        )
    errors, worst, mem = report(rows, fit, fitted)
    if not args.csv:
        picks = top_picks(rows, fit)
        print_picks(picks)
        total = len(picks)
        print(f"published configurations within 10% of our top pick: {sum(p.within for p in picks)}/{total}")
        print(
            f"published configurations within 10% of our top pick with their own recompute, no sequence parallelism: "
            f"{sum(p.within_own for p in picks)}/{total}"
        )
    sources = len({r.name.split("_")[0] for r in rows if r.name not in fitted})
    top = max(worst, default=(float("nan"), "none"))
    median = statistics.median(errors) if errors else float("nan")
    mem_median = statistics.median(mem) if mem else float("nan")
    print(
        f"held-out: median |error| {100 * median:.1f}%; worst {100 * top[0]:.1f}% ({top[1]}); memory median |error| "
        f"{100 * mem_median:.1f}%; {len(errors)} held-out rows from {sources} sources, {len(fitted)} fitted"
    )
    return 0
