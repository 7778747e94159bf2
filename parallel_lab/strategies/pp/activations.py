"""The bytes autograd really holds for backward on a rank, at its peak in a step: what the
planner's ``activation_bytes`` predicts (a schedule's stash of micro-batches).

A saved-tensor hook wraps every tensor autograd saves during the pipeline step (parameters left
out, as the planner leaves them out) in a ``_Held`` that lives exactly as long as autograd keeps
it: a graph is freed when its backward has run. Bytes are counted per storage, as the union of the
byte ranges the saved views cover (views of one tensor count once; a micro-batch that is a slice
of a larger batch counts its own slice)."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of its storage a tensor (any view) can reach."""
    if t.numel() == 0:
        return (0, 0)
    size = t.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.storage_offset() * size, (t.storage_offset() + span) * size)


def _key(t: torch.Tensor) -> int:
    """The tensor's storage (views share it; a meta tensor has no address, its storage an identity)."""
    return t.untyped_storage()._cdata


def _union_length(ranges: Counter) -> int:
    total, end = 0, None
    for a, b in sorted(ranges):
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


class _Held:
    __slots__ = ("tracker", "key", "extent", "tensor")

    def __init__(self, tracker: SavedTracker, key: int, extent: tuple[int, int], tensor: torch.Tensor) -> None:
        self.tracker, self.key, self.extent, self.tensor = tracker, key, extent, tensor

    def __del__(self) -> None:
        self.tracker.change(self.key, self.extent, -1)


class SavedTracker:
    """``with tracker.hooks():`` around a step; ``peak``: the most bytes held at once so far."""

    def __init__(self, params, meta: bool = False) -> None:
        self.params = {_key(p) for p in params}
        self.meta = meta  # count meta tensors too (the planner's replay of a chunk, pp/zero_bubble.py)
        self.ranges: dict[int, Counter] = {}
        self.held = self.peak = 0

    def change(self, key: int, extent: tuple[int, int], delta: int) -> None:
        ranges = self.ranges.setdefault(key, Counter())
        before = _union_length(ranges)
        ranges[extent] += delta
        if ranges[extent] <= 0:
            del ranges[extent]
        self.held += _union_length(ranges) - before
        if not ranges:
            del self.ranges[key]
        self.peak = max(self.peak, self.held)

    def pack(self, t: torch.Tensor):
        if (t.is_meta and not self.meta) or _key(t) in self.params:
            return t
        key, extent = _key(t), _extent(t)
        self.change(key, extent, +1)
        return _Held(self, key, extent, t)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
