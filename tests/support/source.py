"""The package's source walked once per text: the layer and name checks walk every module several
times (and their planted copies of the package are the same text but for the file planted), so
each distinct text is parsed and walked once per test process. Callers only read the nodes."""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.lru_cache(maxsize=None)
def _nodes(text: str, filename: str) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(text, filename)))


def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of the file's tree in ast.walk's order (keyed by the text as it is now, so an
    edited or planted file is parsed anew)."""
    return _nodes(path.read_text(), path.name)
