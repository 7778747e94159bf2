"""make test hands files to its two test processes longest first (tests/conftest.py LONGEST_FIRST):
every name there is an integration file that exists, so a renamed file cannot silently drop out of
the order."""

from __future__ import annotations

from tests.conftest import LONGEST_FIRST
from tests.support.cli import ROOT


def test_every_longest_first_name_is_an_integration_file():
    missing = [name for name in LONGEST_FIRST if not (ROOT / "tests" / "integration" / f"{name}.py").is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names no such file: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), "a file listed twice"
