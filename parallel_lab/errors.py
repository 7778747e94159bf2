"""One error type for bad input, printed as a single line by every entry point."""

from __future__ import annotations

import contextlib
import sys


class ConfigError(ValueError):
    """Bad user input. The message names the bad value and how to fix it, on one line."""


def one_line(message: str) -> str:
    """Collapse a message to one line so users never see a wall of text for bad input."""
    return " ".join(str(message).split())


_quiet = False


def print_warning(message: str) -> None:
    """Something the user should know while the run goes on: one line on stderr."""
    if not _quiet:
        print(f"parallel_lab: warning: {one_line(message)}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def warnings_silenced():
    """For a check that runs again later (and warns then): say nothing now, so nothing is said twice."""
    global _quiet
    saved, _quiet = _quiet, True
    try:
        yield
    finally:
        _quiet = saved
