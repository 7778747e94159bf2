"""Formatting shared by the benchmarks (a leading underscore: not a benchmark itself)."""

from __future__ import annotations


def human(nbytes: int) -> str:
    """A byte count as the tables print it: 4 KiB, 1.5 MiB, 512 B."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"
