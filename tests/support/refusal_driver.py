"""Runs bad inputs through the real command line, each in a process forked from one that has
imported only what ``python -m parallel_lab`` imports before it reads its arguments: reads
``[[case, [override, ...], entry], ...]`` as JSON on stdin (entry: ``parallel_lab``, the default when
left out, or ``parallel_lab.plan``, the planner's command line) and prints, per case, its exit code, its stderr,
the seconds the refusal took after that start (wall, and the child's CPU: user + sys, which the
load of a shared machine does not stretch) and whether torch or DeepSpeed was imported on the
way (tests/unit/test_refusal_imports.py). The start itself is timed once: ``start_s``."""

from __future__ import annotations

import io
import json
import os
import sys
import time

CASE_TIMEOUT_S = 60


def _entry_main(entry: str, overrides: list[str]):
    """The command's main() with its arguments bound; the planner's imports are the child's (its
    CPU counts them: the start imported only the training command's)."""
    if entry == "parallel_lab.plan":
        from parallel_lab.plan.main import main as plan_main

        return lambda: plan_main(overrides)
    from parallel_lab.cli.main import main

    sys.argv = ["parallel_lab", *overrides]
    return main


def _child(overrides: list[str], write_fd: int, entry: str) -> None:
    sys.stdout = io.StringIO()
    err = sys.stderr = io.StringIO()
    try:
        code = _entry_main(entry, overrides)()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        code, err = 99, io.StringIO(f"{type(exc).__name__}: {exc}")
    loaded = {name: name in sys.modules for name in ("torch", "deepspeed")}
    os.write(write_fd, json.dumps({"code": code, "stderr": err.getvalue(), **loaded}).encode())


def run_case(overrides: list[str], entry: str = "parallel_lab") -> dict:
    read_fd, write_fd = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: one refusal, then gone
        os.close(read_fd)
        try:
            _child(overrides, write_fd, entry)
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks, deadline = [], time.monotonic() + CASE_TIMEOUT_S
    with os.fdopen(read_fd, "rb") as pipe:
        chunks.append(pipe.read())
    while (waited := os.wait4(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
        time.sleep(0.01)
    result = json.loads(b"".join(chunks) or b'{"code": 98, "stderr": "no result", "torch": null, "deepspeed": null}')
    result["seconds"] = time.perf_counter() - started
    result["cpu_s"] = waited[2].ru_utime + waited[2].ru_stime
    return result


def main() -> None:
    cases = json.load(sys.stdin)
    started, cpu_started = time.perf_counter(), time.process_time()
    import parallel_lab.cli.main  # noqa: F401  (what the command imports before it reads its arguments)

    start_s, start_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    assert "torch" not in sys.modules, "the command line's first imports load torch"
    print(
        json.dumps(
            {"start_s": start_s, "start_cpu_s": start_cpu_s, "cases": {name: run_case(*rest) for name, *rest in cases}}
        )
    )


if __name__ == "__main__":
    main()
