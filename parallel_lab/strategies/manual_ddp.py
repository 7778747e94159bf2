"""``manual_ddp``: data parallelism written by hand on the point-to-point collectives of
``parallel_lab.comm.collectives`` (the way DDP is taught, but correct and fast).

Communication per optimizer step, per rank, for G bytes of gradients on N ranks:
- setup: every parameter and buffer is broadcast from rank 0 (binomial tree), so all replicas
  start identical whatever their local initialisation was;
- gradients are averaged with ``strategy.allreduce``: ``ring`` sends 2(N-1)/N * G per rank,
  ``star`` makes rank 0 move 2(N-1) * G, ``builtin`` is ``dist.all_reduce``, ``mpi`` is MPI's
  ``Allreduce`` on zero-copy numpy views of the buckets (``parallel_lab.comm.mpi``; only under
  ``launcher=mpirun``, CPU tensors);
- ``strategy.bucketed=false``: one all-reduce of every gradient after backward (simple, no overlap);
  ``strategy.bucketed=true``: gradients are grouped into buckets of ``strategy.bucket_mb`` in
  reverse registration order (about the order backward produces them). A post-accumulate-grad hook
  counts each bucket's ready gradients; a full bucket is handed to a communication thread at once,
  so its all-reduce runs while backward is still computing earlier layers (as in PyTorch DDP,
  Li et al., VLDB 2020, arXiv 2006.15704);
- gradient accumulation: micro-batches before the last only accumulate locally; the hooks fire
  but start no communication, so there is exactly one synchronisation per optimizer step.

Gradients live inside the flat bucket buffers (``p.grad`` is a view, like DDP's
``gradient_as_bucket_view``): backward accumulates straight into the buffer the all-reduce sends,
so there is no copy in and no copy out, and no second gradient copy in memory.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from parallel_lab.comm import collectives, shm
from parallel_lab.comm.counter import trace_label
from parallel_lab.protocol import WAIT_LABEL
from parallel_lab.strategies.base import OptimizerFactory, Strategy
from parallel_lab.strategies.manual_ddp_rules import ManualDDPPlan
from parallel_lab.strategies.precision import Bf16Compute
from parallel_lab.strategies.registry import register
from parallel_lab.strategies.replicated import ReplicatedMemory, ReplicatedState

MB = 1024 * 1024


class Bucket:
    """A flat gradient buffer for a few parameters; each parameter's .grad is a view into it."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0
        self.pending: Future | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def check_views(self) -> None:
        """Backward must have accumulated in place; anything that replaced .grad breaks the sync."""
        for p in self.params:
            if (
                p.grad is None
                or p.grad.data_ptr() < self.buffer.data_ptr()
                or p.grad.data_ptr() >= self.buffer.data_ptr() + self.nbytes
            ):
                raise RuntimeError("manual_ddp: a parameter's .grad was replaced; gradients must stay bucket views")


def make_buckets(params: list[torch.nn.Parameter], cap_bytes: float) -> list[Bucket]:
    """Group parameters (in the order given) into buckets of at most cap_bytes (at least one
    parameter each); a dtype change starts a new bucket because a buffer has one dtype."""
    groups: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not groups or size + nbytes > cap_bytes or groups[-1][0].dtype != p.dtype:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return [Bucket(g) for g in groups]


@register("manual_ddp")
class ManualDDPStrategy(Bf16Compute, Strategy):
    plan = ManualDDPPlan
    State = ReplicatedState
    Memory = ReplicatedMemory

    def setup(self, model: torch.nn.Module, make_optimizer: OptimizerFactory) -> None:
        if self.opts.allreduce == "mpi":
            # Initialise MPI here, in the main thread, before the communication thread calls it.
            from parallel_lab.comm import mpi

            mpi.world(threads=self.opts.bucketed)
        self.model = model.to(self.device)
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            collectives.broadcast(tensor.data, src=0)
        if self.opts.allreduce == "ring":
            # Set up the ring's transport here, on the main thread with every rank in step, rather
            # than inside the first step's communication thread (shm: two small exchanges).
            shm.transport(self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        cap = self.opts.bucket_mb * MB if self.opts.bucketed else float("inf")
        self.buckets = make_buckets(list(reversed(params)), cap)
        self.optimizer = make_optimizer(self.model.parameters())
        self._sync_now = False
        self._next_launch = 0
        self._wait_times: list[float] = []
        self._hooks = []
        self._comm: ThreadPoolExecutor | None = None
        if self.opts.bucketed:
            # One worker thread: buckets are all-reduced one after another, in launch order.
            self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manual_ddp_comm")
            for bucket in self.buckets:
                for p in bucket.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready_hook(bucket)))

    # ----- communication -----
    def _all_reduce(self, bucket: Bucket) -> None:
        # Counted as one logical all-reduce (2x its bytes, the ZeRO paper's unit, as for every
        # other strategy), not as the point-to-point messages it is built from; strategy.allreduce=mpi
        # bypasses torch.distributed, so this record is the only place its bytes are counted.
        with self.comm.as_one("all_reduce", 2 * bucket.nbytes):
            collectives.all_reduce(bucket.buffer, op="mean", algorithm=self.opts.allreduce)

    def _grad_ready_hook(self, bucket: Bucket):
        def hook(_param: torch.Tensor) -> None:
            if not self._sync_now:
                return  # an accumulation micro-batch: no communication
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch_ready_buckets()

        return hook

    def _launch_ready_buckets(self, force: bool = False) -> None:
        """Launch full buckets strictly in bucket order, so every rank issues the same sequence
        of point-to-point messages even if backward finished buckets in a different order."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not force and bucket.ready < len(bucket.params):
                return
            bucket.pending = self._comm.submit(self._all_reduce, bucket)
            self._next_launch += 1

    def _finish_sync(self) -> None:
        """After the last micro-batch's backward: every bucket averaged over the ranks."""
        start = time.perf_counter()
        for bucket in self.buckets:
            bucket.check_views()
        if self._comm is None:
            for bucket in self.buckets:
                self._all_reduce(bucket)
        else:
            # Buckets whose parameters got no gradient hook call (unused in this forward) go now.
            self._launch_ready_buckets(force=True)
            for bucket in self.buckets:
                with trace_label(f"{WAIT_LABEL}bucket"):  # the training thread blocked on the comm thread
                    bucket.pending.result()  # re-raises a communication error here
                bucket.pending, bucket.ready = None, 0
            self._next_launch = 0
        self._wait_times.append(time.perf_counter() - start)

    # ----- training hooks -----
    def train_step(self, inputs, targets, micro: int, num_micro: int) -> torch.Tensor:
        self._sync_now = micro == num_micro - 1
        loss = super().train_step(inputs, targets, micro, num_micro)
        if self._sync_now:
            self._finish_sync()
            self._sync_now = False
        return loss

    def optimizer_step(self) -> None:
        self.clip_gradients()
        self.optimizer.step()
        # Zero in place (not set_to_none): .grad must stay a view into its bucket.
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def extra_metrics(self) -> dict:
        grad_bytes = sum(b.nbytes for b in self.buckets)
        n = self.dp_size
        # Bytes rank 0 sends per step (ring/builtin/mpi: every rank the same, bandwidth-optimal;
        # star: rank 0 is the hub that sends the sum back to N-1 ranks, after receiving N-1 full gradients).
        sent = {
            "ring": 2 * (n - 1) / n * grad_bytes,
            "builtin": 2 * (n - 1) / n * grad_bytes,
            "mpi": 2 * (n - 1) / n * grad_bytes,
            "star": (n - 1) * grad_bytes,
        }
        extras = {}
        if self.opts.allreduce == "mpi":  # which MPI carried the gradients (MPICH, Open MPI...)
            from mpi4py import MPI

            extras["mpi_library"] = " ".join(MPI.Get_library_version().splitlines()[0].split())
        if self.opts.allreduce == "ring":  # which transport carried the ring: shm on one host, else gloo
            extras["hand_transport"] = shm.describe()
        return {
            **extras,
            "buckets": len(self.buckets),
            "bucket_bytes": [b.nbytes for b in self.buckets],
            # Seconds per step the training thread waited for gradient communication after
            # backward (median over steps after warm-up): small = communication was overlapped.
            "exposed_comm_s": statistics.median(self._wait_times[self.cfg.trainer.warmup_steps :] or self._wait_times),
            "analytic_sent_bytes_per_step_rank0": int(sent[self.opts.allreduce]) if n > 1 else 0,
        }

    def teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self._comm is not None:
            self._comm.shutdown(wait=True)
        self._hooks, self._comm, self.buckets = [], None, []
        super().teardown()
