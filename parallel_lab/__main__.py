"""``python -m parallel_lab [overrides]``: the command line lives in :mod:`parallel_lab.cli.main`."""

import sys

from parallel_lab.cli.main import main as cli_main


def main() -> None:
    """The ``parallel-lab`` command."""
    sys.exit(cli_main())


if __name__ == "__main__":
    main()
