"""The two-process half of the quick calibration (``calibrate.measure_calibration``): two real
processes on this machine, one process group (gloo on CPU; nccl on a machine with >= 2 GPUs), that
measure (1) how much slower one computes while the other computes too (``contention``) and (2)
every collective at world 2, 4 KiB-16 MiB (five sizes, the best of 4 calls each over two rounds), fitted to
alpha + bytes / beta. manual_ddp's hand-written ring (``parallel_lab.comm.collectives``) is measured
beside gloo's, as ``impl`` ``hand``, and its star all-reduce (``STAR_OP``: rank 0 gathers, adds and
sends back over gloo's send/recv) at the three smallest sizes, so the step-time model prices each
all-reduce algorithm from its own line."""

from __future__ import annotations

import gc
import json
import multiprocessing
import multiprocessing.process
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from subprocess import PIPE

import torch

TIMEOUT_S = 60.0
HAND_OPS = ("all_reduce", "all_gather", "reduce_scatter")  # manual_ddp broadcasts with gloo
# manual_ddp's star all-reduce (``strategy.allreduce=star``: gloo's send/recv), timed at the three
# smallest sizes only: a call cost 0.24, 0.30, 1.2, 4.5 and 20 ms at 4 KiB-16 MiB on the 2-core CPU,
# five calls a point, so 4 KiB-1 MiB fit its line for ~10 ms where all five took ~130 ms
# (``steptime.star_factors`` prices it per rank 0's messages and bytes).
STAR_OP = "all_reduce_star"
STAR_SIZES = (4096, 1 << 16, 1 << 20)
# Two rounds over every (impl, op, size), each point's fastest call kept: a passing slowdown then
# falls on every size alike instead of bending one op's line (the operators' benchmarks showed it:
# calibrate.OPS_ROUNDS). Each point warms up once, in the first round: its tensors are kept for
# the second, where a warm-up call was a sixth of the collectives' time and timed nothing.
COMM_ROUNDS = 2
COMM_REPS = 2


def _time(fn, device: str, reps: int, warm: bool = True) -> float:
    from parallel_lab.plan.microbench import sync

    if warm:
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
            STAR_OP: lambda: collectives.all_reduce(x, algorithm="star"),
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


def _worker(rank: int, port: int, device: str) -> dict | None:
    """One rank's half of the measurement, on one thread: rank 0 returns {"both": contention probe,
    "rows": impl -> op -> [(bytes, seconds)]} (the slower rank's time of each point), rank 1 None."""
    from parallel_lab.threads import torch_threads

    with torch_threads(1):
        return _measure(rank, port, device)


def _measure(rank: int, port: int, device: str) -> dict | None:
    import torch.distributed as dist

    from parallel_lab.plan.microbench import COMM_OPS, COMM_SIZES, contention_probe

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
        points += [("hand", STAR_OP, s) for s in STAR_SIZES if "hand" in impls]
        bufs = {s: (torch.zeros(s // 4, device=dev), torch.zeros(s // 4, device=dev)) for s in COMM_SIZES}  # any values
        calls = {(i, op, s): _collective(i, op, *bufs[s], 2) for i, op, s in points}
        # interleaved, as the operators' benchmarks (calibrate.OPS_ROUNDS); each rank's times, then the
        # slower rank's of each call (one all-reduce for all: no extra collective between the points)
        times = [_time(calls[p], dev.split(":")[0], COMM_REPS, warm=r == 0) for r in range(COMM_ROUNDS) for p in points]
        slowest = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        by_round = slowest.view(COMM_ROUNDS, len(points)).min(dim=0).values.tolist()
        rows: dict = {}
        for (impl, op, size), t in zip(points, by_round):
            rows.setdefault(impl, {}).setdefault(op, []).append((size, t))
        del calls, bufs
        return {"both": both, "rows": rows} if rank == 0 else None
    finally:
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


@dataclass
class _Rank:
    """One of the two processes, however started: a fresh interpreter (``proc`` a Popen: ready, go
    and the result travel on its stdin/stdout) or a fork of the caller (``conn``: a pipe carries them)."""

    proc: subprocess.Popen | multiprocessing.process.BaseProcess
    conn: Connection | None = None

    def ready(self, timeout: float) -> bool:
        if self.conn is not None:
            return True  # a fork has everything the caller imported: ready as it starts
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return bool(ready) and self.proc.stdout.readline().strip() == "ready"

    def go(self) -> None:
        if self.conn is not None:
            self.conn.send("go")
        else:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()

    def result(self, timeout: float) -> dict | None:
        """Rank 0's measurement (None: none came), the process waited on."""
        if self.conn is not None:
            try:
                out = self.conn.recv() if self.conn.poll(timeout) else None
            except EOFError:  # it ended without answering
                out = None
            self.proc.join(timeout)
            return out
        lines = (self.proc.communicate(timeout=timeout)[0] or "").strip().splitlines()
        return json.loads(lines[-1]) if lines else None

    def code(self) -> int | None:
        return self.proc.exitcode if self.conn is not None else self.proc.poll()

    def stop(self) -> None:
        if self.code() is not None:
            return
        self.proc.kill()
        if self.conn is not None:
            self.proc.join()
        else:
            self.proc.wait()


def start_pairs(device: str) -> list[_Rank] | None:
    """The two processes, started, each waiting for ``finish_pairs``'s go. On a CPU they are forks of
    the caller, which has imported torch already: two fresh interpreters spent ~2.6 s of CPU each
    importing it, beside the caller's untimed work on the same cores. Elsewhere (a GPU: no fork
    once CUDA may be initialised; a caller inside a process group) two subprocesses (``python -m
    parallel_lab.plan.comm_calibration RANK PORT DEVICE``), not multiprocessing's spawn: that re-runs
    the caller's main module, which a script need not guard; they import torch and say ``ready``,
    so the caller can do untimed work meanwhile and time nothing until ``wait_ready``. None on one
    GPU (nothing to pair)."""
    import torch.distributed as dist

    from parallel_lab.plan.microbench import free_port

    if device == "cuda" and torch.cuda.device_count() < 2:
        return None
    port = free_port()
    if device == "cpu" and not dist.is_initialized() and "fork" in multiprocessing.get_all_start_methods():
        return [_fork(rank, port, device) for rank in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "parallel_lab.plan.comm_calibration"]
    return [
        _Rank(subprocess.Popen([*cmd, str(r), str(port), device], env=env, stdin=PIPE, stdout=PIPE, text=True))
        for r in range(2)
    ]


def _fork(rank: int, port: int, device: str) -> _Rank:
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_forked, args=(rank, port, device, theirs), daemon=True)
    proc.start()
    theirs.close()
    return _Rank(proc, mine)


def _forked(rank: int, port: int, device: str, conn: Connection) -> None:
    """A forked rank: the caller's objects frozen out of the collector (a collection would walk every
    one and copy its page, the fork's memory being the caller's until written), then the go, the
    measurement, the result sent (rank 0); multiprocessing ends the fork with os._exit, no teardown."""
    gc.freeze()
    if conn.recv() == "go":
        conn.send(_worker(rank, port, device))


def wait_ready(procs: list[_Rank] | None) -> None:
    """Until both processes have imported what they need, so that their start-up does not slow what
    the caller times next; at most ``TIMEOUT_S``."""
    for p in procs or []:
        if not p.ready(TIMEOUT_S):
            stop_pairs(procs)
            raise RuntimeError(f"the two-process calibration did not start (exit codes {[q.code() for q in procs]})")


def stop_pairs(procs: list[_Rank] | None) -> None:
    """Both processes killed if still running (a failed calibration leaves none behind)."""
    for p in procs or []:
        p.stop()


def finish_pairs(procs: list[_Rank] | None, solo_parent: float, device: str) -> dict:
    """Both processes (``wait_ready`` returned) told to go, their measurement read: {"contention":
    both / alone, "collectives": impl -> op -> alpha-beta}; on one GPU contention 1.0 and no
    collectives (a one-GPU machine has none to calibrate)."""
    from dataclasses import asdict

    if procs is None:
        return {"contention": 1.0, "collectives": {}}
    try:
        for p in procs:  # both told before either is waited on: each needs the other to join the group
            p.go()
        result = [p.result(TIMEOUT_S) for p in procs][0]
    finally:
        stop_pairs(procs)
    if result is None:  # rank 0 sends its result before the group closes: a crash at exit is harmless
        raise RuntimeError(f"the two-process calibration failed (exit codes {[p.code() for p in procs]})")
    fits = {impl: {op: asdict(_fit(points)) for op, points in by_op.items()} for impl, by_op in result["rows"].items()}
    contention = 1.0 if device == "cuda" else max(1.0, result["both"] / solo_parent)
    return {"contention": contention, "collectives": fits}


if __name__ == "__main__":
    # the heavy imports before "ready": nothing costly is left for after it
    import torch.distributed

    from parallel_lab.comm import collectives  # noqa: F401

    gc.freeze()  # all that was imported: the exit's collection walked it for ~0.5-1 s of CPU (measured)
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "go":
        result = _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
        if result is not None:
            print(json.dumps(result), flush=True)
