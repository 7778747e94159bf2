"""torch's intra-op thread count for a block of code (``torch_threads``), torch imported lazily.

Each place that times or computes on a thread count of its own (the calibration's benchmarks and
its two processes, pp's block timings, the MFU peak, the report's parity gaps) sets it for its
block and puts the caller's back after, also when the block raises: a count left changed would
slow, or speed up, whatever the process computes next.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(threads: int | None, only_if_imported: bool = False) -> Iterator[None]:
    """``with torch_threads(1):`` torch on ``threads`` intra-op threads meanwhile (at least 1), the
    previous count restored after. ``None``: unchanged (a GPU's caller). ``only_if_imported``: do
    nothing where torch is not imported yet (a caller that may run without it: the report)."""
    torch = sys.modules.get("torch")
    if torch is None and not only_if_imported:
        import torch
    if threads is None or torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
