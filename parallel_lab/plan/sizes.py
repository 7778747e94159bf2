"""Byte sizes as the planner reads and writes them ('24GiB' in, '24 GiB' out), torch-free: the
command line parses ``plan.device_memory`` before it imports anything heavier (a bad size is
refused in the parent without torch, as ``python -m parallel_lab`` refuses: docs/architecture.md)."""

from __future__ import annotations

import re

from parallel_lab.errors import ConfigError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """'24GiB', '80GB', '512MiB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS or float(match.group(1)) <= 0:
        raise ConfigError(
            f"plan.device_memory={text} is not a size; write e.g. plan.device_memory=24GiB (or 80GB, 512MiB)"
        )
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def human(n: float | None) -> str:
    """Bytes in the largest binary unit they reach, 3 significant digits."""
    if n is None:
        return ""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
