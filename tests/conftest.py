"""Shared fixtures (helpers live in tests/support). ``cli`` runs the real command line: its parent
in this pytest process by default, its workers real processes started by the real launcher."""

from __future__ import annotations

import gc
import os

# Before torch loads OpenMP (libgomp reads it once): an idle OpenMP thread sleeps at once instead of
# spinning for its next task. make test runs two test processes side by side on 2 cores (pytest-xdist),
# each starting ranks, so a process with 2 intra-op threads (a reference, a one-process strategy)
# shares its cores; a spinning thread then holds the core its peer or another process needs: a 4-step
# gpt reference took 5.0 s of CPU under load against 0.36 s with PASSIVE (docs/testing.md). The wait
# policy moves no float: only how a thread waits.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from parallel_lab.cli.run import load_metrics
from tests.support.cli import run_cli


@pytest.fixture(scope="session", autouse=True)
def shared_references(tmp_path_factory) -> None:
    """Every process of this session (both test processes, every rank they start) reads a parity
    reference another one already computed (tests/support/reference.py): the session's temporary
    root, above each test process's own folder under pytest-xdist."""
    from tests.support.reference import SHARED_REFERENCES_ENV

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    os.environ.setdefault(SHARED_REFERENCES_ENV, str(root / "references"))


@pytest.fixture
def cli(tmp_path):
    """cli(*overrides) runs one training run in a fresh folder and returns its metrics (plus run_dir)."""
    counter = iter(range(1000))

    def run(*overrides: str, **kwargs) -> dict:
        run_dir = tmp_path / f"run{next(counter)}"
        run_cli(run_dir, *overrides, **kwargs)
        return {**load_metrics(run_dir), "run_dir": str(run_dir)}

    return run


def pytest_collection_modifyitems(config, items):
    """Mark the tests of tests/support/dispatch.py ``dispatch``: make test's second pass."""
    from tests.support.dispatch import listed

    for item in items:
        if listed(item.nodeid):
            item.add_marker(pytest.mark.dispatch)


def pytest_collection_finish(session):
    """Everything imported by now (torch, Hydra, DeepSpeed, every test module) lives as long as
    the session: frozen, the collector stops walking it again at each full collection, while the
    session composes thousands of configs and trains references (parallel_lab.worker.main does the
    same in every rank)."""
    gc.freeze()
