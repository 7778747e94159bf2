"""Count the communication a strategy actually issues, per rank, in the ZeRO paper's units.

Every collective entry point of ``torch.distributed`` that Python code calls (manual_ddp, FSDP,
DeepSpeed, tensor/pipeline parallel all go through them) is wrapped while a step runs; torch DDP's
C++ reducer bypasses Python, so the ddp strategy reports its buckets through ``record`` from a
comm hook. Volume follows the ZeRO paper (arXiv 1910.02054, section 7): an all-reduce of Ψ elements
moves 2Ψ per rank (reduce-scatter + all-gather), an all-gather or reduce-scatter of a Ψ-element
full tensor moves Ψ, a broadcast or send of Ψ moves Ψ; receives are not counted again.
So DDP/ZeRO-1/2 should show ≈2Ψ per step and ZeRO-3/FSDP full shard ≈3Ψ.

While ``trainer.profile`` records a trace (``parallel_lab.worker.profile``), every counted
collective is also a profiler range named ``comm:<op>:<bytes>`` (``trace_label``), on whichever
thread issued it, and every ``Work.wait()`` is a ``wait:work`` range (``labelled_waits``): the
trace analysis (``parallel_lab.worker.timeline``) reads communication and waiting from these names.
Without profiling neither exists: no wrapper is installed on ``Work`` and no range is opened.

Volume is also kept per process group (``bytes_by_group``): on a 2-D device mesh a strategy names
its groups after the mesh dimensions (``label_group``), so the report can tell the bytes that cross
the replicate dimension (between hosts, in HSDP's layout) from those that stay inside a shard,
tensor- or pipeline-parallel group. The default group is "world"; an unnamed sub-group is named by
its ranks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from parallel_lab.protocol import COMM_LABEL, WAIT_LABEL


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _world(args: dict) -> int:
    return dist.get_world_size(args.get("group"))


WORLD = "world"


def group_key(group) -> str:
    """A process group's name, the same on every rank that belongs to it ("world" for the default)."""
    if group is None or group is dist.group.WORLD:
        return WORLD
    return getattr(group, "group_name", None) or f"group {id(group)}"


# op name -> bytes of volume from the call's bound arguments
VOLUME: dict[str, Callable[[dict], int]] = {
    "all_reduce": lambda a: 2 * _nbytes(a["tensor"]),
    "broadcast": lambda a: _nbytes(a["tensor"]),
    "reduce": lambda a: _nbytes(a["tensor"]),
    "send": lambda a: _nbytes(a["tensor"]),
    "isend": lambda a: _nbytes(a["tensor"]),
    "all_gather_into_tensor": lambda a: _nbytes(a["output_tensor"]),
    "_all_gather_base": lambda a: _nbytes(a["output_tensor"]),
    "all_gather_single": lambda a: _nbytes(a["output_tensor"]),
    "all_gather": lambda a: _nbytes(a["tensor"]) * _world(a),
    "reduce_scatter_tensor": lambda a: _nbytes(a["input"]),
    "_reduce_scatter_base": lambda a: _nbytes(a["input"]),
    "reduce_scatter_single": lambda a: _nbytes(a["input"]),
    "reduce_scatter": lambda a: sum(_nbytes(t) for t in a["input_list"]),
    "all_to_all_single": lambda a: _nbytes(a["input"]),
    "all_to_all": lambda a: sum(_nbytes(t) for t in a["input_tensor_list"]),
}
# Modules whose attribute of that name is the same function (callers use either).
_MODULES = (dist, dist.distributed_c10d)


def _ranks_label(group, key: str) -> str:
    """An unnamed sub-group, named by its global ranks (the same on all of them)."""
    try:
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
    except (RuntimeError, ValueError, TypeError):  # not a c10d group this rank knows: its name will do
        return key


class CommCounter:
    """Bytes of collective volume issued by this rank while ``counting()`` is active."""

    def __init__(self) -> None:
        self.bytes_by_op: Counter[str] = Counter()
        self.calls_by_op: Counter[str] = Counter()
        self.bytes_by_group: Counter[str] = Counter()  # by label_group's name, see group_label
        self._labels: dict[str, str] = {}
        self._active = False
        self._local = threading.local()  # per thread: inside an already-counted operation
        self._originals: list[tuple[object, str, Callable]] = []
        self.profiling = False  # set by the profiler: counted collectives become named trace ranges

    def label_group(self, group, label: str) -> None:
        """Count what is issued on ``group`` under ``label`` (e.g. a mesh dimension's name)."""
        self._labels[group_key(group)] = label

    def group_label(self, group) -> str:
        key = group_key(group)
        if key not in self._labels:
            self._labels[key] = key if key == WORLD else _ranks_label(group, key)
        return self._labels[key]

    def record(self, op: str, nbytes: int, group=None) -> None:
        """Add one collective's volume (also called by strategies whose comm bypasses Python)."""
        if self._active:
            self.bytes_by_op[op] += nbytes
            self.calls_by_op[op] += 1
            self.bytes_by_group[self.group_label(group)] += nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def _wrap(self, op: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if not self._active or getattr(self._local, "inside", False):
                return original(*args, **kwargs)
            # Deprecated entry points call the new ones: count the outermost call only.
            arguments = signature.bind_partial(*args, **kwargs).arguments
            with self.as_one(op, VOLUME[op](arguments), arguments.get("group")):
                return original(*args, **kwargs)

        return counted

    def install(self) -> "CommCounter":
        wrapped: dict[int, Callable] = {}
        for module in _MODULES:
            for op in VOLUME:
                original = getattr(module, op, None)
                if original is None:
                    continue
                key = id(original)
                wrapped.setdefault(key, self._wrap(op, original))
                self._originals.append((module, op, original))
                setattr(module, op, wrapped[key])
        return self

    def uninstall(self) -> None:
        for module, op, original in reversed(self._originals):
            setattr(module, op, original)
        self._originals.clear()

    @contextlib.contextmanager
    def as_one(self, op: str, nbytes: int, group=None) -> Iterator[None]:
        """Count a composite operation once (e.g. an all-reduce built from send/recv) and not
        the collectives it is made of, in this thread."""
        self.record(op, nbytes, group)
        outer, self._local.inside = getattr(self._local, "inside", False), True
        try:
            if self.profiling and self._active:
                with torch.profiler.record_function(f"{COMM_LABEL}{op}:{nbytes}"):
                    yield
            else:
                yield
        finally:
            self._local.inside = outer

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives issued only to measure (memory reports, checksums) are not the strategy's."""
        active, self._active = self._active, False
        try:
            yield
        finally:
            self._active = active

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self._active = True
        try:
            yield
        finally:
            self._active = False


def trace_label(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``name`` while a profiler records, else nothing at all (one flag
    check): strategies mark where their training thread waits (``idle:``/``wait:`` names)."""
    # The Python-side flag: torch.autograd._profiler_enabled() reads False when the profiler
    # records every thread (profile_all_threads), as parallel_lab's does.
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


@contextlib.contextmanager
def labelled_waits() -> Iterator[None]:
    """While profiling: every ``Work.wait()`` (a blocking collective's second half, or the wait on an
    async one: FSDP, DeepSpeed, point-to-point) is a ``wait:work`` range on the thread that waits.
    Installed on the class for the profiled steps only and removed after."""
    work = dist.Work
    original = work.wait

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(f"{WAIT_LABEL}work"):
            return original(self, *args, **kwargs)

    work.wait = wait
    try:
        yield
    finally:
        work.wait = original
