"""``cli/launch.py supervise`` on real subprocesses: it wakes at a process's exit (a pidfd) and,
after a failure, stops whatever still runs once ``grace_s`` has passed."""

from __future__ import annotations

import subprocess
import time

from parallel_lab.cli.launch import Proc, supervise


def _start(*argv: str) -> Proc:
    return Proc(None, subprocess.Popen(list(argv), start_new_session=True))


def test_a_failure_stops_the_rest_after_the_grace_and_its_code_is_returned():
    hung, failing = _start("sleep", "60"), _start("sh", "-c", "sleep 0.2; exit 3")
    start = time.monotonic()
    assert supervise([failing, hung], grace_s=0.5) == 3  # the first non-zero code in rank order
    took = time.monotonic() - start
    assert hung.popen.poll() is not None, "the hung process outlived the grace"
    assert 0.6 < took < 20, took  # the failure at 0.2 s, the grace of 0.5 s; then the stop


def test_all_succeeding_returns_zero_once_the_last_has_ended():
    procs = [_start("sh", "-c", f"sleep {s}") for s in (0.1, 0.3)]
    assert supervise(procs, grace_s=5) == 0
    assert [p.popen.returncode for p in procs] == [0, 0]
