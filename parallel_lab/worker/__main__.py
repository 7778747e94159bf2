"""``python -m parallel_lab.worker <run_dir>/config.yaml [--local_rank N]``: see :mod:`parallel_lab.worker.main`."""

import gc
import sys

# Importing torch and this package allocates ~300k objects that live as long as the rank; with the
# collector on, it walks them again and again while they arrive (0.5 s of a fresh rank's ~3 s of
# imports, measured). main() freezes them and turns it back on.
gc.disable()

from parallel_lab.worker.main import main  # noqa: E402

sys.exit(main())
