"""What a checkpoint costs per strategy: bytes on disk (in units of Ψ = fp32 parameter bytes), files,
save and load time.

    python -m parallel_lab.bench checkpoint [--model resnet18] [--only ddp --only zero3 ...]

Each strategy trains 2 steps and checkpoints (trainer.checkpoint_every=2), then a second run resumes
from that checkpoint for one more step, which times the load. Model + Adam state is 3Ψ (weights,
two moments); DeepSpeed also saves its fp32 master partition (+1Ψ). Save time includes the barriers
and rank 0's sha256 of every file; on 2 shared CPU cores expect noise of tens of percent.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from parallel_lab.checkpoint import checkpoint_name, read_manifest
from parallel_lab.cli.run import run_cli_metrics
from parallel_lab.protocol import default_checkpoint_dir
from parallel_lab.strategies import sweep_names


def _run(run_dir: Path, *overrides: str) -> dict:
    # The parent runs in this process: one interpreter for every run, whose ranks all fork from
    # one zygote (parallel_lab/worker/zygote.py). What is timed (save, load) happens in the ranks.
    return run_cli_metrics(run_dir, "trainer.eval_batches=0", *overrides, timeout=900, in_process=True)


def measure(strategy: str, model: str, workdir: Path) -> dict:
    common = [f"strategy={strategy}", f"model={model}", "trainer.global_batch=16"]
    first = _run(workdir / f"{strategy}_save", *common, "trainer.steps=2", "trainer.checkpoint_every=2")
    folder = default_checkpoint_dir(workdir / f"{strategy}_save") / checkpoint_name(2)
    resumed = _run(workdir / f"{strategy}_load", *common, "trainer.steps=3", f"trainer.resume={folder}")
    files = read_manifest(folder)["files"]
    return {
        "bytes": first["checkpoint_bytes"],
        "psi": first["checkpoint_bytes"] / (4 * first["params"]),
        "files": len(files),
        "save_s": first["checkpoint_save_s"],
        "load_s": resumed["checkpoint_load_s"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet18", choices=["cnn", "resnet18"])
    strategies = sweep_names()  # every registered strategy, plugins included
    parser.add_argument("--only", choices=strategies, action="append", help="just these strategies")
    args = parser.parse_args(argv)
    print(f"| strategy ({args.model}) | checkpoint MiB | in Ψ | files | save s | load s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        for strategy in args.only or strategies:
            m = measure(strategy, args.model, Path(workdir))
            print(
                f"| {strategy} | {m['bytes'] / 2**20:.1f} | {m['psi']:.2f} | {m['files']} | {m['save_s']:.2f} | "
                f"{m['load_s']:.2f} |",
                flush=True,
            )
    return 0
