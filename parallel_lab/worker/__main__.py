"""``python -m parallel_lab.worker <run_dir>/config.yaml [--local_rank N]``: see :mod:`parallel_lab.worker.main`."""

import sys

from parallel_lab.worker.main import main

sys.exit(main())
