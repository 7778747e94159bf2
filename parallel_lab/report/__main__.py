"""``python -m parallel_lab.report <dir> [<dir> ...] [--out DIR]``: the comparison of finished runs,
rendered again (the same files a sweep writes at its end)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parallel_lab.protocol import METRICS_FILE
from parallel_lab.report.rows import load_runs
from parallel_lab.report.timing import read_peaks
from parallel_lab.report.write import write_report


def main(argv: list[str] | None = None) -> int:
    """Render the comparison of the runs under the given folders again; 2 for bad folders."""
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run or sweep folders holding metrics.json files")
    parser.add_argument("--out", type=Path, default=None, help="where to write comparison.* (default: first dir)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        print(
            f"parallel_lab.report: error: not a folder: {', '.join(missing)}; pass run or sweep folders",
            file=sys.stderr,
        )
        return 2
    runs = load_runs(args.dirs)
    if not runs:
        print(
            f"parallel_lab.report: error: no {METRICS_FILE} under {', '.join(map(str, args.dirs))}; run a sweep first",
            file=sys.stderr,
        )
        return 2
    # MFU needs this machine's peak as the sweep measured it (peak.json); without one it stays blank
    print(write_report(runs, args.out or args.dirs[0], read_peaks(args.dirs)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
