"""Collective bandwidth on one machine: mpi4py (buffer API) vs torch.distributed gloo vs the
hand-written collectives training uses (``parallel_lab.comm.collectives``: the segmented ring of
manual_ddp, and its binomial-tree broadcast, on torch send/recv), in ONE mpiexec job, plus memcpy
as the ceiling.

    python -m parallel_lab.bench collectives [--np 2] [--min-bytes 1K] [--max-bytes 64M]
                                             [--factor 4] [--max-iters 200] [--ops ...] [--impls ...]
                                             [--hand-transport auto|shm|p2p] [--json calibration.json]

Run without mpiexec, it starts ``mpiexec -n NP python -m mpi4py`` on itself (one job: MPI and a
gloo group whose ranks and rendezvous come from the MPI environment, via parallel_lab.comm.dist_env).
Under your own mpiexec, run it as ``python -m mpi4py -m parallel_lab.bench.collectives``: mpi4py's
runner aborts the job when a rank raises.

Definitions (as in nccl-tests), with p ranks, S bytes and t the slowest rank's median time per call:
  algbw = S / t, where S is the whole vector (all_reduce, broadcast: the tensor; all_gather: the
          output; reduce_scatter: the input);
  busbw = algbw * f with f = 2(p-1)/p for all_reduce, (p-1)/p for all_gather and reduce_scatter,
          1 for broadcast: the bytes each rank's link must carry per second in an optimal
          algorithm, so it is comparable across ops and p, and with the link (here: memory).
Every process of the job lives on one machine, so "the link" is memory and the CPU cores doing
the copies; the single-process memcpy line is the ceiling for busbw.

The hand column's ring (all_reduce, reduce_scatter, all_gather) runs over whatever transport
training would use (``parallel_lab.comm.shm.transport``: shared memory when every rank is on this
host, gloo's isend/irecv otherwise); the header names it. ``--hand-transport p2p`` (the environment
variable ``PARALLEL_LAB_HAND_TRANSPORT``) times the gloo path instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from parallel_lab.bench._format import human

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
IMPLS = ("mpi4py", "gloo", "hand")  # hand: parallel_lab.comm.collectives, what manual_ddp trains with


def parse_bytes(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GIB": 1 << 30}
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    if not digits.isdigit() or t[len(digits) :] not in units or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size; use e.g. 1K, 64M, 4096")
    return int(digits) * units[t[len(digits) :]]


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be an integer >= 1")
    return int(text)


def bus_factor(op: str, p: int) -> float:
    return {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p, "broadcast": 1.0}[
        op
    ]


# ---- one (impl, op): buffers + a call, and a way to read the result ---------------------------
def make_call(impl: str, op: str, inp: np.ndarray, comm, rank: int, p: int) -> tuple[Callable, Callable]:
    """inp: this rank's input (n/p elements for all_gather, n otherwise). Returns (run, result)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    n = inp.size * p if op == "all_gather" else inp.size
    if impl == "mpi4py":
        send = inp.copy()
        out = {"all_reduce": n, "all_gather": n, "reduce_scatter": n // p, "broadcast": 0}[op]
        recv = np.empty(out, dtype=inp.dtype)
        run = {
            "all_reduce": lambda: comm.Allreduce(send, recv, op=MPI.SUM),
            "all_gather": lambda: comm.Allgather(send, recv),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(send, root=0),
        }[op]
        return run, (lambda: send) if op == "broadcast" else (lambda: recv)
    x = torch.from_numpy(inp.copy())
    if impl == "gloo":
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        out = torch.empty(n if op == "all_gather" else n // p, dtype=x.dtype)
        run = {
            "all_reduce": lambda: dist.all_reduce(x),
            "all_gather": lambda: all_gather(out, x),
            "reduce_scatter": lambda: reduce_scatter(out, x),
            "broadcast": lambda: dist.broadcast(x, src=0),
        }[op]
        return run, (lambda: out.numpy()) if op in ("all_gather", "reduce_scatter") else (lambda: x.numpy())
    # hand: the hand-written collectives manual_ddp trains with (parallel_lab.comm.collectives):
    # the segmented ring for all_reduce, reduce_scatter and all_gather, a binomial tree for broadcast.
    from parallel_lab.comm import collectives

    if op == "all_gather":  # every rank's input is its chunk of the full buffer
        full = torch.empty(n, dtype=x.dtype)

        def run():
            collectives.ring_chunks(full, p)[rank].copy_(x)
            collectives.all_gather(full)

        return run, lambda: full.numpy()
    if op == "reduce_scatter":
        return (lambda: collectives.reduce_scatter(x)), (lambda: collectives.ring_chunks(x, p)[rank].numpy())
    if op == "all_reduce":
        return (lambda: collectives.all_reduce(x, algorithm="ring")), (lambda: x.numpy())
    return (lambda: collectives.broadcast(x, src=0)), (lambda: x.numpy())


def rank_input(op: str, n: int, rank: int, p: int, zeros: bool) -> np.ndarray:
    """Zeros for timing (repeated in-place sums stay finite); small integers for the check."""
    m = n // p if op == "all_gather" else n
    if zeros:
        return np.zeros(m, dtype=np.float32)
    return ((np.arange(m) % 7) + 10 * (rank + 1)).astype(np.float32)


def expected(op: str, n: int, rank: int, p: int) -> np.ndarray:
    inputs = [rank_input(op, n, r, p, zeros=False) for r in range(p)]
    if op == "all_gather":
        return np.concatenate(inputs)
    if op == "broadcast":
        return inputs[0]
    total = np.sum(inputs, axis=0)
    return total if op == "all_reduce" else np.array_split(total, p)[rank]


def memcpy_gbps(nbytes: int, reps: int = 10) -> float:
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return src.nbytes * reps / (time.perf_counter() - t0) / 1e9


def time_call(impl: str, op: str, n: int, comm, rank: int, p: int, args) -> float:
    """Median seconds per call over this round's iterations, the slowest rank's (MAX over ranks)."""
    from mpi4py import MPI

    run, _ = make_call(impl, op, rank_input(op, n, rank, p, zeros=True), comm, rank, p)
    iters = max(args.min_iters, min(args.max_iters, args.budget_bytes // (4 * n)))
    for _ in range(args.warmup):
        run()
    comm.Barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    # Median per call (robust to a descheduled rank on shared cores); the slowest rank sets the
    # pace of a collective, hence MAX over ranks.
    return comm.allreduce(float(np.median(times)), op=MPI.MAX)


def run_job(args) -> int:
    """Inside mpiexec: every rank runs this."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from parallel_lab.comm import shm
    from parallel_lab.comm.dist_env import init_process_group, read_dist_env

    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    # The others wait in the Barrier. Two sizes: the largest (memory-bound) and 256 KiB (fits in
    # cache, so small collectives can beat the big-copy number).
    ceiling = (memcpy_gbps(args.max_bytes), memcpy_gbps(256 << 10, reps=200)) if rank == 0 else (0.0, 0.0)
    comm.Barrier()
    if args.hand_transport:  # before the first collective: shm.transport() reads it on every call
        os.environ[shm.TRANSPORT_ENV] = args.hand_transport
    env = read_dist_env("cpu")
    init_process_group(env, timeout_s=300)
    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= args.factor
    cases = [(op, max(p, (nbytes // 4) // p * p)) for op in args.ops for nbytes in sizes]  # float32, n % p == 0
    for op, n in cases:  # correctness first: one call per impl on known integers, exact comparison
        for impl in args.impls:
            run, result = make_call(impl, op, rank_input(op, n, rank, p, zeros=False), comm, rank, p)
            run()
            if not np.array_equal(result(), expected(op, n, rank, p)):
                raise AssertionError(f"{impl} {op} at {n} elements gave a wrong result on rank {rank}")
    # Rounds: every round times every (op, size, impl) once, the impls back to back, so load that
    # drifts during the run (a shared machine) lands on all of them alike; the table reports the
    # median over rounds of each round's median.
    per_round: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for op, n in cases:
            for impl in args.impls:
                per_round.setdefault((op, n, impl), []).append(time_call(impl, op, n, comm, rank, p, args))
    rows = []
    for op, n in cases:
        row = {"op": op, "bytes": 4 * n}
        row.update({impl: float(np.median(per_round[(op, n, impl)])) for impl in args.impls})
        rows.append(row)
    transport = shm.describe()  # what the hand column's ring ran over
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print_table(rows, args, p, ceiling, transport)
        if args.json:  # the calibration python -m parallel_lab.bench plantime reads (alpha-beta fits)
            import json

            payload = {"world_size": p, "loadavg": os.getloadavg(), "impls": args.impls, "rows": rows}
            Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def print_table(rows, args, p: int, ceiling: tuple[float, float], transport: str = "p2p") -> None:
    import torch
    from mpi4py import MPI

    print(
        f"collectives bench: {p} ranks on one machine ({os.cpu_count()} CPUs), float32, 1 thread/rank; "
        f"torch {torch.__version__} gloo; {MPI.Get_library_version().splitlines()[0].strip()}"
    )
    print(
        f"memcpy ceiling (1 process, numpy copyto): {human(args.max_bytes)} {ceiling[0]:.2f} GB/s, "
        f"256 KiB (in cache) {ceiling[1]:.2f} GB/s; bytes copied per second: the ceiling for busbw, "
        f"since every byte a rank sends or receives here is at least one memory copy"
    )
    print(
        "time = slowest rank's median per call; algbw = bytes/time; busbw = algbw x "
        f"(all_reduce {2 * (p - 1) / p:.2f}, all_gather/reduce_scatter {(p - 1) / p:.2f}, broadcast 1); GB/s = 1e9 B/s"
    )
    if "hand" in args.impls:
        print(f"hand = parallel_lab.comm.collectives; its ring's transport: {transport} (broadcast: gloo p2p)")
    head = "| op | size |" + "".join(f" {i} us | {i} algbw | {i} busbw |" for i in args.impls)
    print(head)
    print("|" + "---|" * (2 + 3 * len(args.impls)))
    for row in rows:
        cells = [row["op"], human(row["bytes"])]
        for impl in args.impls:
            t = row[impl]
            alg = row["bytes"] / t / 1e9
            cells += [f"{t * 1e6:.1f}", f"{alg:.3f}", f"{alg * bus_factor(row['op'], p):.3f}"]
        print("| " + " | ".join(cells) + " |")
    if {"hand", "gloo"} <= set(args.impls):
        print_ratios(rows, args, p, ceiling)


def print_ratios(rows, args, p: int, ceiling: tuple[float, float]) -> None:
    """The hand-written collectives as ratios: busbw against gloo, MPI and the memcpy ceiling (the
    in-cache one up to 256 KiB), and time against gloo's (latency, what matters for small sizes)."""
    mpi = "mpi4py" in args.impls
    print(f"\nhand-written collectives as ratios (median of {args.rounds} rounds; > 1 = hand ahead, except time)")
    print(
        "| op | size | hand/gloo busbw |"
        + (" hand/mpi4py busbw |" if mpi else "")
        + " hand busbw/memcpy | hand time/gloo time |"
    )
    print("|" + "---|" * (5 + mpi))
    for row in rows:
        hand, gloo = row["hand"], row["gloo"]
        busbw = row["bytes"] / hand / 1e9 * bus_factor(row["op"], p)
        cells = [row["op"], human(row["bytes"]), f"{gloo / hand:.2f}"]
        cells += [f"{row['mpi4py'] / hand:.2f}"] if mpi else []
        cells += [f"{busbw / ceiling[0 if row['bytes'] > 256 << 10 else 1]:.2f}", f"{hand / gloo:.2f}"]
        print("| " + " | ".join(cells) + " |")


def under_mpi() -> bool:
    from parallel_lab.comm.dist_env import MPI_MARKERS

    return any(k in os.environ for k in MPI_MARKERS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m parallel_lab.bench collectives", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--np", type=positive, default=2, help="ranks for mpiexec -n (default 2)")
    parser.add_argument("--min-bytes", type=parse_bytes, default=1 << 10, help="smallest size (default 1K)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 << 20, help="largest size (default 64M)")
    parser.add_argument("--factor", type=int, default=4, choices=(2, 4, 8, 16), help="size step (default x4)")
    parser.add_argument("--min-iters", type=positive, default=3)
    parser.add_argument("--max-iters", type=positive, default=200)
    parser.add_argument(
        "--budget-bytes",
        type=parse_bytes,
        default=128 << 20,
        help="iterations per size = budget / size, clamped to [min-iters, max-iters]",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=positive, default=5, help="rounds; the table shows their median (default 5)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument(
        "--hand-transport",
        choices=("auto", "shm", "p2p"),
        default=None,
        help="the hand ring's transport (sets PARALLEL_LAB_HAND_TRANSPORT; default: that variable, else auto)",
    )
    parser.add_argument("--json", default=None, help="also write the rows (seconds per call) to this file")
    args = parser.parse_args(argv)
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if under_mpi() or args.np == 1:
        return run_job(args)
    from parallel_lab.cli.launch import find_tool

    tool = find_tool("mpiexec", "install MPI with pip install mpi4py mpich (make installs it)")
    forwarded = argv if argv is not None else sys.argv[1:]
    # mpi4py's runner (python -m mpi4py) aborts the whole job when one rank raises, so no rank is
    # left waiting in a collective for a peer that is gone.
    cmd = [tool, "-n", str(args.np), sys.executable, "-m", "mpi4py", "-m", "parallel_lab.bench.collectives", *forwarded]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
