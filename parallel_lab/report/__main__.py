"""``python -m parallel_lab.report <dir> [<dir> ...] [--out DIR]``."""

import sys

from parallel_lab.report.table import main

sys.exit(main())
