"""``python -m parallel_lab.bench allreduce``: the hand-written all-reduces against the library's.

Part 1, collectives: for each size, spawned gloo ranks on 127.0.0.1 all-reduce a float32 tensor
with ``star``, ``ring`` and ``builtin`` (``dist.all_reduce``) and print, as nccl-tests do,
algbw = bytes / time and busbw = algbw * 2(N-1)/N (the per-link traffic of an optimal all-reduce,
comparable across N). Each timed iteration starts after a barrier; the median is reported.

Part 2, training step: the same resnet18 run with ``manual_ddp`` (bucketed, ring) and torch
``ddp`` through the real CLI; median step time from metrics.json.

On a shared CPU machine the numbers are noisy: run it on an idle machine for a fair comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from parallel_lab.bench._format import human

KIB = 1024
DEFAULT_SIZES = [KIB * 4**k for k in range(9)]  # 1 KiB, 4 KiB, ..., 64 MiB
ALGORITHMS = ("star", "ring", "builtin")


def iterations(nbytes: int, max_iters: int, budget_bytes: int) -> int:
    """Many iterations for small sizes (latency noise), few for big ones (time)."""
    return max(3, min(max_iters, budget_bytes // max(nbytes, 1)))


def measure(
    rank: int,
    world_size: int,
    sizes: list[int],
    algorithms: list[str],
    max_iters: int,
    budget_bytes: int,
    segment_bytes: int | None = None,
) -> None:
    """Run on every rank (by parallel_lab.cli.run.run_ranks); rank 0 prints a JSON list."""
    import torch
    import torch.distributed as dist

    from parallel_lab.comm import collectives

    rows = []
    for nbytes in sizes:
        tensor = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        times: dict[str, list[float]] = {a: [] for a in algorithms}
        # Algorithms take turns within each iteration, so drifting machine load hits them alike.
        for it in range(iterations(nbytes, max_iters, budget_bytes) + 1):
            for algorithm in algorithms:
                dist.barrier()
                start = time.perf_counter()
                collectives.all_reduce(tensor, op="sum", algorithm=algorithm, segment_bytes=segment_bytes)
                if it:  # the first one is a warm-up (buffer allocation, connection setup)
                    times[algorithm].append(time.perf_counter() - start)
        for algorithm in algorithms:
            seconds = statistics.median(times[algorithm])
            algbw = tensor.numel() * 4 / seconds
            rows.append(
                {
                    "bytes": nbytes,
                    "algorithm": algorithm,
                    "time_s": seconds,
                    "iters": len(times[algorithm]),
                    "algbw": algbw,
                    "busbw": algbw * 2 * (world_size - 1) / world_size,
                }
            )
    if rank == 0:
        print(json.dumps(rows))


def collective_table(rows: list[dict], world_size: int) -> str:
    lines = [
        f"all_reduce, float32, world_size={world_size} (gloo, 127.0.0.1); GB/s = 1e9 bytes/s",
        "| size | "
        + " | ".join(f"{a} time | {a} algbw | {a} busbw" for a in ALGORITHMS if any(r["algorithm"] == a for r in rows))
        + " | ring/builtin busbw |",
    ]
    algos = [a for a in ALGORITHMS if any(r["algorithm"] == a for r in rows)]
    lines.append("|" + "---|" * (1 + 3 * len(algos) + 1))
    for nbytes in sorted({r["bytes"] for r in rows}):
        by = {r["algorithm"]: r for r in rows if r["bytes"] == nbytes}
        cells = []
        for a in algos:
            r = by[a]
            cells += [f"{r['time_s'] * 1e3:.3f} ms", f"{r['algbw'] / 1e9:.3f}", f"{r['busbw'] / 1e9:.3f}"]
        ratio = by["ring"]["busbw"] / by["builtin"]["busbw"] if "ring" in by and "builtin" in by else float("nan")
        lines.append(f"| {human(nbytes)} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(lines)


def step_time(strategy_args: list[str], common: list[str], timeout: float) -> dict:
    """One real CLI run; returns its metrics.json."""
    from parallel_lab.cli.run import run_cli_metrics

    with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as run_dir:
        return run_cli_metrics(Path(run_dir), *common, *strategy_args, timeout=timeout)


def allreduce_runs() -> dict[str, list[str]]:
    """label -> overrides: every way a registered strategy all-reduces its gradients
    (``PlanRules.allreduce_variants``), library reducers first."""
    from parallel_lab.strategies import get_strategy_class, sweep_names

    runs = {}
    for name in sweep_names():
        for label, overrides in get_strategy_class(name).plan.allreduce_variants.items():
            runs[label] = [f"strategy={name}", *overrides]
    return runs


def step_table(args) -> str:
    common = [
        f"model={args.model}",
        f"world_size={args.world_size}",
        f"trainer.steps={args.steps}",
        f"trainer.global_batch={args.global_batch}",
        "trainer.eval_batches=0",
    ]
    runs = allreduce_runs()
    times: dict[str, list[float]] = {name: [] for name in runs}
    exposed: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits every row alike
        for name, strategy_args in runs.items():
            metrics = step_time(strategy_args, common, args.timeout)
            times[name].append(metrics["step_time_s"])
            if "exposed_comm_s" in metrics["strategy_extras"]:
                exposed[name].append(metrics["strategy_extras"]["exposed_comm_s"])
    first = next(iter(runs))
    base = statistics.median(times[first])
    lines = [
        f"training step, {args.model}, world_size={args.world_size}, global_batch={args.global_batch}, "
        f"{args.steps} steps (median after warm-up), {args.repeats} run(s) each",
        f"| strategy | step time | vs {first} | exposed comm (wait after backward) |",
        "|---|---|---|---|",
    ]
    for name in runs:
        t = statistics.median(times[name])
        wait = f"{statistics.median(exposed[name]) * 1e3:.1f} ms" if exposed[name] else "n/a"
        lines.append(f"| {name} | {t * 1e3:.1f} ms | {t / base:.2f}x | {wait} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench allreduce", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="message sizes in bytes")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per size at most")
    parser.add_argument("--budget-mb", type=int, default=256, help="fewer iterations once iters x size exceeds this")
    parser.add_argument(
        "--segment-kib", type=int, default=None, help="ring segment size (default: collectives.SEGMENT_BYTES)"
    )
    parser.add_argument("--model", default="resnet18", choices=("cnn", "resnet18"))
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="CLI runs per strategy for the step-time table")
    parser.add_argument("--skip-collectives", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a hung run is killed")
    args = parser.parse_args(argv)
    if not args.skip_collectives:
        from parallel_lab.cli.run import run_ranks

        out = run_ranks(
            measure,
            world_size=args.world_size,
            timeout=args.timeout,
            sizes=args.sizes,
            algorithms=args.algorithms,
            max_iters=args.iters,
            budget_bytes=args.budget_mb * KIB * KIB,
            segment_bytes=args.segment_kib * KIB if args.segment_kib else None,
        )
        print(collective_table(json.loads(out[0]), args.world_size), flush=True)
        print()
    if not args.skip_step:
        print(step_table(args), flush=True)
    return 0
