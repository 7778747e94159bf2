"""Toolkit overhead: parallel_lab's ddp and zero2 against bare scripts doing the same training.

    python -m parallel_lab.bench overhead [--rounds 3] [--steps 30]

Runs, alternating so machine noise hits both sides alike, `python -m parallel_lab strategy=ddp`
vs `torchrun benchmarks/bare_ddp.py`, and `strategy=zero2` vs `torchrun benchmarks/bare_zero2.py`,
on the same model (cnn), global batch, steps and one thread per rank. Each side reports the median
step time after warm-up (excluding data loading and start-up); the ratio printed is
parallel_lab samples/s / bare samples/s (target >= 0.95).
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


def run_toolkit(strategy: str, steps: int, batch: int, workdir: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    metrics = run_cli_metrics(
        run_dir, f"strategy={strategy}", f"trainer.steps={steps}", f"trainer.global_batch={batch}", timeout=600
    )
    return metrics["samples_per_s"]


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
    args = parser.parse_args(argv)
    print(f"| strategy | parallel_lab samples/s | bare samples/s | ratio (median of {args.rounds}) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        for strategy in args.only or sorted(PAIRS):
            ours, bare = [], []
            for _ in range(args.rounds):  # alternate: noise lands on both sides
                ours.append(run_toolkit(strategy, args.steps, args.global_batch, Path(workdir)))
                bare.append(run_bare(PAIRS[strategy], args.steps, args.global_batch))
            ratio = statistics.median(o / b for o, b in zip(ours, bare))
            print(
                f"| {strategy} | {statistics.median(ours):.0f} | {statistics.median(bare):.0f} | {ratio:.3f} |",
                flush=True,
            )
    return 0
