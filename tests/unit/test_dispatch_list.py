"""The second pass's list (tests/support/dispatch.py) names tests that exist in make test, each a
float comparison (marked parity or floats), so it cannot go stale or pick a test that compares nothing."""

from __future__ import annotations

import pytest

from tests.support.cli import ROOT
from tests.support.dispatch import DISPATCH, listed


class _Items:
    """A pytest plugin keeping the collected items (one in-process collection of the suite)."""

    def __init__(self) -> None:
        self.items: list = []

    def pytest_collection_finish(self, session) -> None:
        self.items = list(session.items)


def test_every_listed_prefix_is_a_collected_float_comparison():
    plugin = _Items()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")], plugins=[plugin])
    assert code == 0
    marks = {item.nodeid: {m.name for m in item.iter_markers()} for item in plugin.items}
    second = [n for n, m in marks.items() if "dispatch" in m and "extra" not in m]
    for prefix in DISPATCH:
        assert any(listed(n) == prefix for n in second), f"{prefix}: no such test in make test"
    strays = [n for n in second if not marks[n] & {"parity", "floats"}]
    assert not strays, f"listed but compares no floats (no parity/floats marker): {strays}"


def test_listed_matches_ids_and_not_lookalikes():
    prefix = "tests/integration/test_spine.py::test_single_and_ddp_match_independent_reference"
    assert listed(prefix + "[ddp]") == prefix
    assert listed(prefix + "_more") is None
    assert listed("tests/unit/test_parity.py::test_x") == "tests/unit/test_parity.py"
