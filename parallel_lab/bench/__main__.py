"""``python -m parallel_lab.bench <name> [args]``: a tiny name -> module dispatch.

Each benchmark is a module ``parallel_lab/bench/<name>.py`` with ``main(argv) -> int``.
"""
from __future__ import annotations

import importlib
import sys

BENCHES = {
    "collectives": "parallel_lab.bench.collectives",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m parallel_lab.bench <name> [args]; names: {', '.join(sorted(BENCHES))}",
              file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
