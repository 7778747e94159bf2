"""The two-process half of the quick calibration (``calibrate.measure_calibration``): two real
processes on this machine, one process group (gloo on CPU; nccl on a machine with >= 2 GPUs), that
measure (1) how much slower one computes while the other computes too (``contention``) and (2)
every collective at world 2, 4 KiB-16 MiB (five sizes, the best of 4 calls each over two rounds), fitted to
alpha + bytes / beta. manual_ddp's hand-written ring (``parallel_lab.comm.collectives``) is measured
beside gloo's, as ``impl`` ``hand``."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from datetime import timedelta

import torch

TIMEOUT_S = 60.0
HAND_OPS = ("all_reduce", "all_gather", "reduce_scatter")  # manual_ddp broadcasts with gloo
# Two rounds over every (impl, op, size), each point's fastest call kept: a passing slowdown then
# falls on every size alike instead of bending one op's line (the operators' benchmarks showed it:
# calibrate.OPS_ROUNDS).
COMM_ROUNDS = 2
COMM_REPS = 2


def _time(fn, device: str, reps: int) -> float:
    from parallel_lab.plan.microbench import sync

    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed call: a loaded machine adds, never removes


def _collective(impl: str, op: str, x: torch.Tensor, out: torch.Tensor, world: int):
    import torch.distributed as dist

    if impl == "hand":
        from parallel_lab.comm import collectives

        return {
            "all_reduce": lambda: collectives.all_reduce(x, algorithm="ring"),
            "all_gather": lambda: collectives.all_gather(out),
            "reduce_scatter": lambda: collectives.reduce_scatter(out),
            "broadcast": lambda: collectives.broadcast(x, src=0),
        }[op]
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_single(out, x[: out.numel() // world]),
        "reduce_scatter": lambda: dist.reduce_scatter_single(x[: out.numel() // world], out),
        "broadcast": lambda: dist.broadcast(x, src=0),
    }[op]


def _worker(rank: int, port: int, device: str) -> None:
    import torch.distributed as dist

    from parallel_lab.plan.microbench import COMM_OPS, COMM_SIZES, contention_probe

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S)
    )
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    try:
        dist.barrier()
        both = contention_probe(dev, before_each=dist.barrier)  # both ranks' passes at once; the parent timed it alone
        impls = ["gloo" if device == "cpu" else "nccl"] + (["hand"] if device == "cpu" else [])
        points = [(i, op, s) for i in impls for op in (COMM_OPS if i != "hand" else HAND_OPS) for s in COMM_SIZES]
        fastest = dict.fromkeys(points, float("inf"))
        for _ in range(COMM_ROUNDS):  # interleaved, as the operators' benchmarks (calibrate.OPS_ROUNDS)
            for impl, op, size in points:
                x = torch.zeros(size // 4, device=dev)
                out = torch.zeros(size // 4, device=dev)
                t = _time(_collective(impl, op, x, out, 2), dev.split(":")[0], reps=COMM_REPS)
                slowest = torch.tensor([t], device=dev)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                fastest[impl, op, size] = min(fastest[impl, op, size], slowest.item())
        rows: dict = {}
        for impl, op, size in points:
            rows.setdefault(impl, {}).setdefault(op, []).append((size, fastest[impl, op, size]))
        if rank == 0:
            print(json.dumps({"both": both, "rows": rows}), flush=True)
        del x, out
    finally:
        import gc

        from parallel_lab.comm import shm

        shm.reset()
        gc.collect()
        dist.barrier()  # a clean gloo exit (docs/facts.md)
        dist.destroy_process_group()


def _fit(points: list):
    """alpha-beta through the points; where noise makes the large size no slower than the small
    one (no positive bandwidth), the small call's time as alpha and the large call's as bandwidth."""
    from parallel_lab.plan.alphabeta import AlphaBeta, fit_alpha_beta

    try:
        return fit_alpha_beta([tuple(p) for p in points])
    except ValueError:
        (_, t_small), (s_large, t_large) = min(points), max(points)
        return AlphaBeta(t_small, s_large / t_large)


def start_pairs(device: str) -> list[subprocess.Popen] | None:
    """The two processes, started: each imports torch (~1.5 s of this machine's CPU) and then waits
    for a line on its stdin, so the caller can do untimed work meanwhile and time nothing until
    ``wait_ready``. Two subprocesses (``python -m parallel_lab.plan.comm_calibration RANK PORT
    DEVICE``), not multiprocessing's spawn: that re-runs the caller's main module, which a script
    need not guard. None on one GPU (nothing to pair)."""
    from parallel_lab.plan.microbench import free_port

    if device == "cuda" and torch.cuda.device_count() < 2:
        return None
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "parallel_lab.plan.comm_calibration"]
    return [
        subprocess.Popen(
            [*cmd, str(r), port, device], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]


def wait_ready(procs: list[subprocess.Popen] | None) -> None:
    """Until both processes have imported what they need (each prints ``ready``), so that their
    start-up does not slow what the caller times next; at most ``TIMEOUT_S``."""
    for p in procs or []:
        ready, _, _ = select.select([p.stdout], [], [], TIMEOUT_S)
        if not ready or p.stdout.readline().strip() != "ready":
            stop_pairs(procs)
            raise RuntimeError(f"the two-process calibration did not start (exit codes {[q.poll() for q in procs]})")


def stop_pairs(procs: list[subprocess.Popen] | None) -> None:
    """Both processes killed if still running (a failed calibration leaves none behind)."""
    for p in procs or []:
        if p.poll() is None:
            p.kill()
            p.wait()


def finish_pairs(procs: list[subprocess.Popen] | None, solo_parent: float, device: str) -> dict:
    """Both processes (``wait_ready`` returned) told to go, their measurement read: {"contention":
    both / alone, "collectives": impl -> op -> alpha-beta}; on one GPU contention 1.0 and no
    collectives (a one-GPU machine has none to calibrate)."""
    from dataclasses import asdict

    if procs is None:
        return {"contention": 1.0, "collectives": {}}
    try:
        for p in procs:  # both told before either is waited on: each needs the other to join the group
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        stop_pairs(procs)
    lines = (outs[0] or "").strip().splitlines()
    if not lines:  # rank 0 prints its result before the group closes: a crash at exit is harmless
        raise RuntimeError(f"the two-process calibration failed (exit codes {[p.returncode for p in procs]})")
    result = json.loads(lines[-1])
    fits = {impl: {op: asdict(_fit(points)) for op, points in by_op.items()} for impl, by_op in result["rows"].items()}
    contention = 1.0 if device == "cuda" else max(1.0, result["both"] / solo_parent)
    return {"contention": contention, "collectives": fits}


if __name__ == "__main__":
    # the heavy imports before "ready": nothing costly is left for after it
    import torch.distributed

    from parallel_lab.comm import collectives  # noqa: F401

    print("ready", flush=True)
    if sys.stdin.readline().strip() == "go":
        _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
