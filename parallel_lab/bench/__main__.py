"""``python -m parallel_lab.bench <name> [args]``: runs ``parallel_lab/bench/<name>.py``'s ``main(argv)``.

Every module of this package is a benchmark; adding one needs no registration here.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import parallel_lab.bench as package


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in names():
        print(f"usage: python -m parallel_lab.bench {{{','.join(names())}}} [args]", file=sys.stderr)
        return 2
    return importlib.import_module(f"parallel_lab.bench.{argv[0]}").main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
