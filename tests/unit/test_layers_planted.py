"""Each check of tests/unit/test_layers.py that follows dynamic imports, finds strategy names
inside strings, or compares the docs' layer table with LAYERS, shown to fail: the violation is
planted in a copy of the package (or of the docs) and the check must catch it."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.unit.test_layers import (
    _ROW,
    BASELINE,
    DOCS,
    PACKAGE,
    circles,
    import_graph,
    modules,
    named_strategies,
    table_differences,
    unlisted_dynamic_imports,
    upward_imports,
    write_table,
)


def _planted(tmp_path: Path, files: dict[str, str]) -> Path:
    """A copy of the package with the files given written over it (or added)."""
    package = tmp_path / "parallel_lab"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    for name, source in files.items():
        (package / name).write_text(source)
    return package


def test_the_dynamic_import_checks_can_fail(tmp_path: Path) -> None:
    """An import_module whose target is written in the code is followed (a layer-3 module loading
    the worker, a discovery loop over the worker package); one whose target is not is refused
    until listed."""
    package = _planted(
        tmp_path,
        {
            "comm/planted_up.py": "import importlib\nimportlib.import_module('parallel_lab.worker.train')\n",
            "comm/planted_scan.py": (
                "import importlib\nfor n in ('a',):\n    importlib.import_module(f'parallel_lab.worker.{n}')\n"
            ),
            "comm/planted_hidden.py": (
                "from importlib import import_module\ndef load(n):\n    return import_module(n)\n"
            ),
        },
    )
    bad = upward_imports(import_graph(package))
    assert any(line.startswith("parallel_lab.comm.planted_up -> parallel_lab.worker.train") for line in bad), bad
    assert any(line.startswith("parallel_lab.comm.planted_scan -> parallel_lab.worker.zygote") for line in bad), bad
    unlisted, _ = unlisted_dynamic_imports(package)
    assert [line for line in unlisted if "planted_hidden" in line] and not [u for u in unlisted if "planted_up" in u]


def test_discovery_is_followed() -> None:
    """strategies/__init__.py's discovery is an edge to every module of the package (the layer check
    sees them), and bench/__main__.py's to every benchmark; with those edges there is no circle, and
    a strategy module importing ``register`` from the package root instead of strategies/registry.py
    would make one."""
    graph = import_graph()
    children = {m for m in modules() if m.rsplit(".", 1)[0] == "parallel_lab.strategies"}
    assert children and children <= graph["parallel_lab.strategies"]
    assert {f"parallel_lab.bench.{n}" for n in ("zero_paper", "collectives")} <= graph["parallel_lab.bench.__main__"]
    assert not circles(graph)
    graph["parallel_lab.strategies.ddp"].add("parallel_lab.strategies")  # the registry's old shape
    assert any("parallel_lab.strategies" in c and "parallel_lab.strategies.ddp" in c for c in circles(graph))


def test_the_name_check_can_fail(tmp_path: Path) -> None:
    """The baseline's name is written outside strategies/ (the report compares with it): as if it
    were any other strategy's, the check finds it. Names inside strings are found, prose is not."""
    assert named_strategies({BASELINE})
    package = _planted(
        tmp_path,
        {
            "bench/planted_names.py": (
                "def f(stage, other):\n"
                "    a = ['strategy=zero0', f'model={other}']\n"
                "    b = f'+strategy=dp,{other}'\n"
                "    c = f'strategy=zero{stage}'\n"
                "    d = 'strategy.name=tp'\n"
                "    return a, b, c, d\n"
            ),
            "bench/planted_prose.py": (
                '"""strategy=zero0 in a docstring is documentation."""\n'
                "def g(name):\n"
                "    return [f'strategy={name}', 'the dp degree times the tp degree', 'mystrategy=dp']\n"
            ),
        },
    )
    found = [line for line in named_strategies({"zero0", "zero", "dp", "tp"}, package) if "planted" in line]
    assert {line.split(": ")[1].split()[0] for line in found if "planted_names" in line} == {
        "'zero0'",
        "'dp'",
        "'zero'",
        "'tp'",
    }
    assert not [line for line in found if "planted_prose" in line], found


def test_the_docs_table_check_can_fail() -> None:
    """A row whose packages differ from LAYERS, a missing row, an empty "what lives there": each is caught,
    and --write-docs puts the table back."""
    text = DOCS.read_text()
    assert not table_differences(write_table(text)) and write_table(text) == text
    moved = text.replace("| 2 | `models`, `data`, `optim` |", "| 2 | `models`, `data` |")
    assert moved != text and table_differences(moved)
    rows = [line for line in text.splitlines() if _ROW.match(line)]
    assert table_differences(text.replace(rows[-1] + "\n", ""))
    assert table_differences(text.replace(rows[0], rows[0].rsplit("|", 2)[0] + "|  |"))
    assert not table_differences(write_table(moved))
