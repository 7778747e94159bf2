"""``python -m parallel_lab.prepare <run_dir> [overrides]``: kept for ``launch/*.sh``; the code is
:mod:`parallel_lab.cli.prepare`."""

import sys

from parallel_lab.cli.prepare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
