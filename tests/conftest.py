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


# The longest files of make test, longest first (wall seconds of each whole file, measured): under
# ``--dist loadfile --no-loadscope-reorder`` the two test processes take files in this order, so the
# longest start first and the short ones fill in at the end, instead of one process finishing the
# Slurm and multi-host file alone while the other idles (longest-processing-time-first scheduling).
LONGEST_FIRST = (
    "test_multinode",
    "test_sharded",
    "test_failures",
    "test_reshard",
    "test_spine",
    "test_mpi",
    "test_checkpoint",
    "test_parity",
    "test_ds_config",
    "test_defaults",
    "test_recompute",
    "test_tp_vit",
    "test_pipeline_parallel",
    "test_meshes",
    "test_plugins",
    "test_pp_vit",
    "test_bf16",
    "test_tensor_parallel",
    "test_cp_vit",
    "test_comparison",
)


def _file_rank(item) -> int:
    listed = item.path.stem in LONGEST_FIRST and "integration" in item.path.parts
    return LONGEST_FIRST.index(item.path.stem) if listed else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Mark the tests of tests/support/dispatch.py ``dispatch`` (make test's second pass), and put
    the longest files first (LONGEST_FIRST; each file's tests keep their order)."""
    from tests.support.dispatch import listed

    for item in items:
        if listed(item.nodeid):
            item.add_marker(pytest.mark.dispatch)
    items.sort(key=_file_rank)  # stable: the rest stay in collection order


def pytest_collection_finish(session):
    """Everything imported by now (torch, Hydra, DeepSpeed, every test module) lives as long as
    the session: frozen, the collector stops walking it again at each full collection, while the
    session composes thousands of configs and trains references (parallel_lab.worker.main does the
    same in every rank)."""
    gc.freeze()
