"""``python -m parallel_lab [overrides]``: the command line lives in :mod:`parallel_lab.cli.main`."""

import gc
import sys

from parallel_lab.cli.main import main as cli_main


def main() -> None:
    """The ``parallel-lab`` command."""
    code = cli_main()
    # Everything alive now out of the exit's collection: with torch imported it walked ~300k
    # objects, 0.5-1 s of CPU after the work was done (measured).
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    main()
