"""One error type for bad input, printed as a single line by every entry point."""

from __future__ import annotations

import sys
from typing import Callable


class ConfigError(ValueError):
    """Bad user input. The message names the bad value and how to fix it, on one line."""


def one_line(message: str) -> str:
    """Collapse a message to one line so users never see a wall of text for bad input."""
    return " ".join(str(message).split())


Warn = Callable[[str], None]  # where a check sends a warning (validate(..., warn=...))


def print_warning(message: str) -> None:
    """Something the user should know while the run goes on: one line on stderr."""
    print(f"parallel_lab: warning: {one_line(message)}", file=sys.stderr, flush=True)
