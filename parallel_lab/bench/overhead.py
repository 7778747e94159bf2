"""Toolkit overhead: parallel_lab's ddp and zero2 against bare scripts doing the same training.

    python -m parallel_lab.bench overhead [--rounds 3] [--steps 30]

Runs, alternating so machine noise hits both sides alike, `python -m parallel_lab strategy=ddp
launcher=torchrun` vs `torchrun benchmarks/bare_ddp.py`, and `strategy=zero2` vs
`torchrun benchmarks/bare_zero2.py`, on the same model (cnn), global batch, steps and one thread per
rank. Each side reports the median step time after warm-up (excluding data loading and start-up);
the ratio printed is parallel_lab samples/s / bare samples/s (target >= 0.95).

Both sides start the same way: torchrun's agent exec's two fresh Python ranks and stays beside them
(on a 2-core box a third process). The toolkit's default launcher instead forks its ranks from a
process that already imported torch; that start is shown in its own column (``--forked``), for
information only: comparing it with a torchrun-started script measured the start-up, not the toolkit
(it read 1.13-1.18x "faster" than the bare scripts, which no wrapper can be).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from parallel_lab.cli.run import run_cli_metrics
from parallel_lab.comm.dist_env import free_port

ROOT = Path(__file__).resolve().parents[2]
# strategy -> the plain script doing the same training without the toolkit: benchmarks/bare_<strategy>.py
PAIRS = {
    path.stem.removeprefix("bare_"): f"benchmarks/{path.name}"
    for path in sorted((ROOT / "benchmarks").glob("bare_*.py"))
}


# What each side's timed step contains, printed above the table so the ratio says what it compares.
INCLUDES = (
    "both sides: 2 ranks, gloo, cnn, synthetic-size batches, Adam(foreach=False), 1 thread/rank, median "
    "step time after 2 warm-up steps; timed: forward + backward (with DDP's bucketed all-reduce or ZeRO's "
    "reduce-scatter) + optimizer step + zero_grad; not timed: data loading, process start, loss report",
    "parallel_lab (torchrun): python -m parallel_lab launcher=torchrun, i.e. torchrun exec's the ranks; its "
    "timed step also holds the toolkit's own work (communication counting, the strategy's hooks, BatchNorm "
    "running-stat sync where a model has BatchNorm)",
    "bare (torchrun): torchrun benchmarks/bare_<strategy>.py, plain torch DDP / DeepSpeed engine with the "
    "toolkit's default settings (DDP: 25 MiB buckets, gradient_as_bucket_view; ZeRO-2: 25 MiB buckets, no step log)",
    "parallel_lab (forked, info): the default launcher, ranks forked from a process that already imported torch",
)


def run_toolkit(strategy: str, steps: int, batch: int, workdir: Path, launcher: str = "torchrun") -> float:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    overrides = (
        f"strategy={strategy}",
        f"launcher={launcher}",
        f"trainer.steps={steps}",
        f"trainer.global_batch={batch}",
    )
    return run_cli_metrics(run_dir, *overrides, timeout=600)["samples_per_s"]


def run_bare(script: str, steps: int, batch: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        script,
        "--steps",
        str(steps),
        "--global-batch",
        str(batch),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=600, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--only", choices=sorted(PAIRS), action="append", help="just these strategies")
    parser.add_argument("--forked", action="store_true", help="also time the toolkit's default (forked) start")
    args = parser.parse_args(argv)
    print("\n".join(INCLUDES))
    forked_head = " parallel_lab forked samples/s (info) |" if args.forked else ""
    print(f"| strategy | parallel_lab samples/s | bare samples/s | ratio (median of {args.rounds}) |{forked_head}")
    print("|---|---|---|---|" + ("---|" if args.forked else ""))
    with tempfile.TemporaryDirectory() as workdir:
        for strategy in args.only or sorted(PAIRS):
            ours, bare, forked = [], [], []
            for _ in range(args.rounds):  # alternate: noise lands on both sides
                ours.append(run_toolkit(strategy, args.steps, args.global_batch, Path(workdir)))
                bare.append(run_bare(PAIRS[strategy], args.steps, args.global_batch))
                if args.forked:
                    forked.append(run_toolkit(strategy, args.steps, args.global_batch, Path(workdir), "spawn"))
            ratio = statistics.median(o / b for o, b in zip(ours, bare))
            extra = f" {statistics.median(forked):.0f} |" if forked else ""
            print(
                f"| {strategy} | {statistics.median(ours):.0f} | {statistics.median(bare):.0f} | {ratio:.3f} |{extra}",
                flush=True,
            )
    return 0
