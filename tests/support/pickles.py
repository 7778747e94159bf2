"""Pickles that run a command when they are loaded: what a tampered data file or checkpoint would
carry. The loaders under test must refuse them without running anything."""

from __future__ import annotations

import os
from pathlib import Path


class Evil:
    """Runs ``echo pwned`` when unpickled (a CIFAR-10 batch file's payload)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Planted:
    """Touches marker when unpickled, so a test can tell whether it ran (a checkpoint's payload)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
