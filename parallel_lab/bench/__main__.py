"""``python -m parallel_lab.bench <name> [args]``: a tiny name -> module dispatch."""
from __future__ import annotations

import importlib
import sys

BENCHES = {
    "allreduce": "parallel_lab.bench.allreduce",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python -m parallel_lab.bench {{{','.join(sorted(BENCHES))}}} [args]", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
