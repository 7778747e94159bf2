"""Resharding and export at scale: seconds and peak RSS against one full copy of the state.

    python -m parallel_lab.bench reshard zero3@2 fsdp@1 --width 4.25      # resnet18, 201 M parameters

Trains ``source`` (strategy@world) for one step on resnet18 scaled by ``--width`` and checkpoints it,
then continues that checkpoint under ``target`` with ``trainer.reshard=true`` (the rank records the
load's seconds and its peak RSS right after it: ``resharded_from.load_s`` / ``.peak_rss_bytes`` in
metrics.json), then runs ``python -m parallel_lab.checkpoint export --optimizer`` and ``inspect``,
each in a fresh process that reports its own peak RSS. "One copy" is the parameters plus Adam's two
moments in fp32: 12 bytes per parameter. Streaming keeps every reader at one tensor at a time
(parallel_lab/checkpoint/full_state.py), so the reshard's peak is the target's own state plus the
interpreter plus about two of the largest tensor; the issue's bound is 1.5 copies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel_lab.checkpoint import checkpoint_name
from parallel_lab.cli.run import run_cli_metrics
from parallel_lab.protocol import default_checkpoint_dir

CHILD = """
import json, resource, sys, time
from parallel_lab.checkpoint.__main__ import main
import parallel_lab.checkpoint.export  # main() imports it lazily: loaded before the clock, the time is export's alone
started = time.perf_counter()
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "s": time.perf_counter() - started,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def layout(text: str) -> tuple[str, int]:
    """'strategy@world' -> (strategy, world)."""
    strategy, _, world = text.partition("@")
    if not strategy or not world.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not strategy@world, e.g. fsdp@1")
    return strategy, int(world)


def _child(*args: str) -> dict:
    """The checkpoint command in a fresh interpreter: its seconds (without the imports) and peak RSS."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=1800, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(source: tuple[str, int], target: tuple[str, int], width: float, workdir: Path) -> dict:
    common = ["model=resnet18", f"model.width={width}", "trainer.global_batch=4", "trainer.eval_batches=0"]
    first = run_cli_metrics(
        workdir / "source",
        f"strategy={source[0]}",
        f"world_size={source[1]}",
        *common,
        "trainer.steps=1",
        "trainer.checkpoint_every=1",
        timeout=1800,
    )
    folder = default_checkpoint_dir(workdir / "source") / checkpoint_name(1)
    resumed = run_cli_metrics(
        workdir / "target",
        f"strategy={target[0]}",
        f"world_size={target[1]}",
        *common,
        "trainer.steps=2",
        f"trainer.resume={folder}",
        "trainer.reshard=true",
        timeout=1800,
    )
    started = time.perf_counter()
    exported = _child("export", str(folder), str(workdir / "export"), "--optimizer")
    exported["wall_s"] = time.perf_counter() - started
    inspected = _child("inspect", str(folder))
    return {"params": first["params"], "reshard": resumed["resharded_from"], "export": exported, "inspect": inspected}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench reshard", description=__doc__.split("\n")[0])
    parser.add_argument("source", type=layout, help="strategy@world that writes the checkpoint")
    parser.add_argument("target", type=layout, help="strategy@world that continues it with trainer.reshard=true")
    parser.add_argument("--width", type=float, default=4.25, help="resnet18 width (4.25: 201 M parameters)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        m = measure(args.source, args.target, args.width, Path(workdir))
    copy = 12 * m["params"]  # fp32 parameters + Adam's exp_avg and exp_avg_sq
    src, tgt = (f"{s}@{w}" for s, w in (args.source, args.target))
    print(f"resnet18 width {args.width}: {m['params']:,} parameters; one copy (params + Adam) = {copy / 2**30:.2f} GiB")
    print("| what | seconds | peak RSS GiB | peak RSS / one copy |")
    print("|---|---|---|---|")
    rows = [
        (f"reshard {src} -> {tgt} (load, in the rank)", m["reshard"]["load_s"], m["reshard"]["peak_rss_bytes"]),
        ("export --optimizer (safetensors)", m["export"]["s"], m["export"]["rss"]),
        ("inspect", m["inspect"]["s"], m["inspect"]["rss"]),
    ]
    for what, seconds, rss in rows:
        print(f"| {what} | {seconds:.1f} | {rss / 2**30:.2f} | {rss / copy:.2f} |")
    return 0
