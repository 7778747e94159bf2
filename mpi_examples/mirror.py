"""Every MPI collective beside its torch.distributed twin, in ONE mpirun job, checked equal.

    mpiexec -n 2 python mpi_examples/mirror.py [--k 4] [--json out.json]
    python mpi_examples/mirror.py                 # size 1 works too

Each rank runs every collective twice on identical inputs: once through mpi4py (the buffer API,
on numpy arrays) and once through torch.distributed (gloo, on tensors), and asserts the two
results are bit-identical. Inputs are small integer-valued float64 arrays, so every reduction
order gives the same bits. Rank 0 prints a table collective | mpi4py | torch | equal.

torch has no MPI backend here (``dist.is_mpi_available()`` is False), so the torch side is a gloo
group whose rank, world size and rendezvous come from the MPI environment through
``parallel_lab.comm.dist_env``: the same code the training worker uses, so this is also the proof that
the worker's environment reading works under mpirun.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
from common import abort_on_exception
from mpi4py import MPI


class RankZeroParser(argparse.ArgumentParser):
    """Every rank parses the same argv; only rank 0 prints the error, every rank exits 2."""

    def error(self, message):
        if MPI.COMM_WORLD.Get_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = RankZeroParser(prog="mirror.py", description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=positive, default=4, help="elements per rank (default 4)")
    parser.add_argument("--json", help="rank 0 writes every row (full results) to this file")
    return parser.parse_args(argv)


# Bad input is refused before torch loads (about 2 s of CPU a rank): as the program, this file
# checks its arguments here, above the imports of torch.
ARGS = parse_args(None) if __name__ == "__main__" else None

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel_lab.comm.dist_env import DistEnv, init_process_group, read_dist_env  # noqa: E402

ROOT = 0
# torch 2.13 renamed the flat-tensor collectives (the old names still work, with a FutureWarning);
# older torch (pyproject allows >= 2.4) has only the old ones.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Ctx:
    comm: MPI.Comm
    rank: int
    size: int
    k: int  # elements per rank

    @property
    def x(self) -> np.ndarray:
        """This rank's k values: rank*k+1 .. rank*k+k."""
        return np.arange(self.rank * self.k + 1, (self.rank + 1) * self.k + 1, dtype=np.float64)

    @property
    def full(self) -> np.ndarray:
        """A size*k vector per rank (for Scatter, Reduce_scatter, Alltoall): 100*rank + 1..size*k."""
        return 100.0 * self.rank + np.arange(1, self.size * self.k + 1, dtype=np.float64)

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.size


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.copy())


# ---- the MPI side (mpi4py buffer API) and the torch side of each collective -------------------
def mpi_bcast(c):
    b = c.x.copy()
    c.comm.Bcast(b, root=ROOT)
    return b


def torch_bcast(c):
    b = t(c.x)
    dist.broadcast(b, src=ROOT)
    return b.numpy()


def mpi_scatter(c):
    out = np.empty(c.k)
    c.comm.Scatter(c.full if c.rank == ROOT else None, out, root=ROOT)
    return out


def torch_scatter(c):
    out = torch.empty(c.k, dtype=torch.float64)
    pieces = list(t(c.full).tensor_split(c.size)) if c.rank == ROOT else None
    dist.scatter(out, pieces, src=ROOT)
    return out.numpy()


def mpi_gather(c):
    out = np.empty(c.size * c.k) if c.rank == ROOT else None
    c.comm.Gather(c.x, out, root=ROOT)
    return out


def torch_gather(c):
    parts = [torch.empty(c.k, dtype=torch.float64) for _ in range(c.size)] if c.rank == ROOT else None
    dist.gather(t(c.x), parts, dst=ROOT)
    return torch.cat(parts).numpy() if parts else None


def mpi_allgather(c):
    out = np.empty(c.size * c.k)
    c.comm.Allgather(c.x, out)
    return out


def torch_allgather(c):
    out = torch.empty(c.size * c.k, dtype=torch.float64)
    ALL_GATHER(out, t(c.x))
    return out.numpy()


OPS = {
    "SUM": (MPI.SUM, dist.ReduceOp.SUM),
    "PROD": (MPI.PROD, dist.ReduceOp.PRODUCT),
    "MAX": (MPI.MAX, dist.ReduceOp.MAX),
    "MIN": (MPI.MIN, dist.ReduceOp.MIN),
}


def mpi_reduce(op):
    def run(c):
        out = np.empty(c.k) if c.rank == ROOT else None
        c.comm.Reduce(c.x, out, op=OPS[op][0], root=ROOT)
        return out

    return run


def torch_reduce(op):
    def run(c):
        x = t(c.x)
        dist.reduce(x, dst=ROOT, op=OPS[op][1])  # only the root's tensor is defined afterwards
        return x.numpy() if c.rank == ROOT else None

    return run


def mpi_allreduce(op):
    def run(c):
        out = np.empty(c.k)
        c.comm.Allreduce(c.x, out, op=OPS[op][0])
        return out

    return run


def torch_allreduce(op):
    def run(c):
        x = t(c.x)
        dist.all_reduce(x, op=OPS[op][1])
        return x.numpy()

    return run


def mpi_reduce_scatter(c):
    out = np.empty(c.k)
    c.comm.Reduce_scatter_block(c.full, out, op=MPI.SUM)
    return out


def torch_reduce_scatter(c):
    out = torch.empty(c.k, dtype=torch.float64)
    REDUCE_SCATTER(out, t(c.full), op=dist.ReduceOp.SUM)
    return out.numpy()


def mpi_alltoall(c):
    out = np.empty(c.size * c.k)
    c.comm.Alltoall(c.full, out)
    return out


def torch_alltoall(c):
    out = torch.empty(c.size * c.k, dtype=torch.float64)
    dist.all_to_all_single(out, t(c.full))
    return out.numpy()


def mpi_barrier(c):
    c.comm.Barrier()
    return np.zeros(0)  # no data: "both returned" is the whole result


def torch_barrier(c):
    dist.barrier()
    return np.zeros(0)


# Point to point. Rank 1 sends to rank 0, so the root (which prints) holds the received data.
def mpi_send_recv(c):
    if c.rank == 1:
        c.comm.Send(c.x, dest=0, tag=5)
    elif c.rank == 0:
        out = np.empty(c.k)
        c.comm.Recv(out, source=1, tag=5)
        return out
    return None


def torch_send_recv(c):
    if c.rank == 1:
        dist.send(t(c.x), dst=0, tag=5)
    elif c.rank == 0:
        out = torch.empty(c.k, dtype=torch.float64)
        dist.recv(out, src=1, tag=5)
        return out.numpy()
    return None


def mpi_isend_irecv(c):
    """Ring shift: send to the right, receive from the left, both non-blocking."""
    out = np.empty(c.k)
    reqs = [c.comm.Irecv(out, source=c.left, tag=6), c.comm.Isend(c.x, dest=c.right, tag=6)]
    MPI.Request.Waitall(reqs)
    return out


def torch_isend_irecv(c):
    out, x = torch.empty(c.k, dtype=torch.float64), t(c.x)
    reqs = [dist.irecv(out, src=c.left, tag=6), dist.isend(x, dst=c.right, tag=6)]
    for req in reqs:
        req.wait()
    return out.numpy()


def mpi_sendrecv(c):
    """One step of a ring: send right and receive left in ONE call (cannot deadlock)."""
    out = np.empty(c.k)
    c.comm.Sendrecv(c.x, dest=c.right, sendtag=7, recvbuf=out, source=c.left, recvtag=7)
    return out


def torch_sendrecv(c):
    """torch has no sendrecv; batch_isend_irecv posts both halves together, which is its twin."""
    out, x = torch.empty(c.k, dtype=torch.float64), t(c.x)
    ops = [dist.P2POp(dist.isend, x, c.right), dist.P2POp(dist.irecv, out, c.left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out.numpy()


@dataclass(frozen=True)
class Case:
    name: str  # what the teaching material (the seeds) calls it
    mpi_call: str
    torch_call: str
    mpi: Callable
    torch: Callable
    min_ranks: int = 1  # point-to-point needs a peer: gloo cannot send to its own rank


CASES = [
    Case("broadcast", "Bcast", "broadcast", mpi_bcast, torch_bcast),
    Case("scatter", "Scatter", "scatter", mpi_scatter, torch_scatter),
    Case("gather", "Gather", "gather", mpi_gather, torch_gather),
    Case("all-gather", "Allgather", ALL_GATHER.__name__, mpi_allgather, torch_allgather),
    *[
        Case(f"reduce {op}", f"Reduce({op})", f"reduce({tname})", mpi_reduce(op), torch_reduce(op))
        for op, tname in (("SUM", "SUM"), ("PROD", "PRODUCT"), ("MAX", "MAX"), ("MIN", "MIN"))
    ],
    *[
        Case(f"all-reduce {op}", f"Allreduce({op})", f"all_reduce({tname})", mpi_allreduce(op), torch_allreduce(op))
        for op, tname in (("SUM", "SUM"), ("PROD", "PRODUCT"), ("MAX", "MAX"), ("MIN", "MIN"))
    ],
    Case("reduce-scatter", "Reduce_scatter_block", REDUCE_SCATTER.__name__, mpi_reduce_scatter, torch_reduce_scatter),
    Case("all-to-all", "Alltoall", "all_to_all_single", mpi_alltoall, torch_alltoall),
    Case("barrier", "Barrier", "barrier", mpi_barrier, torch_barrier),
    Case("send/recv", "Send/Recv", "send/recv", mpi_send_recv, torch_send_recv, 2),
    Case("isend/irecv", "Isend/Irecv+Waitall", "isend/irecv+wait", mpi_isend_irecv, torch_isend_irecv, 2),
    Case("sendrecv (ring step)", "Sendrecv", "batch_isend_irecv", mpi_sendrecv, torch_sendrecv, 2),
]


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def fmt(a, limit: int = 6) -> str:
    if a is None:
        return "-"
    if a.size == 0:
        return "(returned)"
    vals = ", ".join(f"{v:g}" for v in a[:limit]) + (", ..." if a.size > limit else "")
    return f"[{vals}]"


def run_all(ctx: Ctx) -> list[dict]:
    rows = []
    for case in CASES:
        if ctx.size < case.min_ranks:
            rows.append(
                dict(
                    name=case.name,
                    mpi_call=case.mpi_call,
                    torch_call=case.torch_call,
                    mpi=None,
                    torch=None,
                    equal=None,
                    note=f"needs >= {case.min_ranks} ranks",
                )
            )
            continue
        a, b = case.mpi(ctx), case.torch(ctx)
        equal_everywhere = ctx.comm.allreduce(same(a, b), op=MPI.LAND)
        rows.append(
            dict(
                name=case.name,
                mpi_call=case.mpi_call,
                torch_call=case.torch_call,
                mpi=None if a is None else a.tolist(),
                torch=None if b is None else b.tolist(),
                equal=bool(equal_everywhere),
                note="",
            )
        )
    return rows


def print_table(rows: list[dict], env: DistEnv, size: int, k: int) -> None:
    print(
        f"mirror: {size} MPI ranks; torch.distributed gloo rank/world from {env.source} "
        f"({env.world_size}), rendezvous tcp://{env.master_addr}:{env.master_port}; k={k} per rank"
    )
    print(
        f"| {'collective':<20} | {'mpi4py':<20} | {'torch.distributed':<22} | {'mpi result (rank 0)':<28} "
        f"| {'torch result (rank 0)':<28} | equal |"
    )
    print(f"|{'-' * 22}|{'-' * 22}|{'-' * 24}|{'-' * 30}|{'-' * 30}|-------|")
    for r in rows:
        a = None if r["mpi"] is None else np.array(r["mpi"])
        b = None if r["torch"] is None else np.array(r["torch"])
        eq = r["note"] or ("yes" if r["equal"] else "NO")
        print(f"| {r['name']:<20} | {r['mpi_call']:<20} | {r['torch_call']:<22} | {fmt(a):<28} | {fmt(b):<28} | {eq} |")


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD
    abort_on_exception(comm)
    args = ARGS if argv is None and ARGS is not None else parse_args(argv)

    torch.set_num_threads(1)
    env = read_dist_env("cpu")  # rank/world/rendezvous from the MPI environment, as the worker reads them
    assert (env.rank, env.world_size) == (comm.Get_rank(), comm.Get_size()), (
        f"dist_env read rank {env.rank}/{env.world_size} but MPI says {comm.Get_rank()}/{comm.Get_size()}"
    )
    init_process_group(env, timeout_s=60)
    ctx = Ctx(comm, comm.Get_rank(), comm.Get_size(), args.k)
    rows = run_all(ctx)
    gc.collect()  # the clean-exit recipe (docs/facts.md): no references, barrier, destroy
    dist.barrier()
    dist.destroy_process_group()
    bad = [r["name"] for r in rows if r["equal"] is False]
    if ctx.rank == 0:
        print_table(rows, env, ctx.size, ctx.k)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": ctx.size, "k": ctx.k, "source": env.source, "rows": rows}, f, indent=1)
        verdict = "MISMATCH in " + ", ".join(bad) if bad else "every MPI result equals its torch.distributed twin"
        print(f"mirror: {verdict}")
    return 1 if bad else 0  # `bad` comes from an allreduce: every rank exits the same way


if __name__ == "__main__":
    sys.exit(main())
