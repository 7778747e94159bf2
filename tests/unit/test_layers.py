"""The map of the code, checked: imports run one way (a package imports only packages in lower
layers, or itself), no module takes part in an import circle (imports inside functions count), and
outside ``parallel_lab/strategies/`` no code names a strategy except the baseline ``single``.

``python tests/unit/test_layers.py`` prints the layers and every import between packages.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "parallel_lab"

# Bottom to top. A package may import its own modules and any package of a lower layer; packages
# in one layer are independent of each other. docs/architecture.md explains each layer.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("hashing", "protocol", "plugins", "choices"),  # records, plugin discovery, the typed choices
    ("models", "data", "optim"),  # single-device: know nothing of processes or parallelism
    ("comm", "checkpoint"),  # process groups and collectives; atomic files and manifests
    ("strategies",),  # one class (+ helpers) per parallelism; the registry
    ("config",),  # Hydra schema, composition, validation (the parent only)
    ("plan",),  # predictions from a validated config, before any process starts
    ("worker",),  # one rank: the generic training loop, metrics.json
    ("report",),  # reads records (protocol) and judges parity
    ("cli",),  # the command line, launchers, sweeps
    ("bench", "__main__", "prepare"),  # entry points; benchmarks start the command line, print ratios
]
BASELINE = "single"


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool, known: dict) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            prefix = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
    resolved = []
    for name in names:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known and name != module:
            resolved.append(name)
    return resolved


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at module level or inside functions."""
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_targets(module, node, path.name == "__init__.py", known))
    return graph


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(package: str) -> int:
    for index, members in enumerate(LAYERS):
        if package in members:
            return index
    raise AssertionError(f"parallel_lab/{package} is in no layer: add it to LAYERS in {Path(__file__).name}")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = package_of(source), package_of(target)
            if a == b or "__init__" in (a, b):  # the package root: its version and docstring only
                continue
            if layer_of(b) >= layer_of(a):
                bad.append(f"{source} -> {target} ({a} is layer {layer_of(a)}, {b} is layer {layer_of(b)})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(modules()):
        if node not in index:
            visit(node)
    return found


def strategy_names() -> set[str]:
    """Every registered strategy name, and the family prefix of ZeRO's stages."""
    from parallel_lab.strategies import registered_names

    return {*registered_names(), "zero"} - {BASELINE}


def named_strategies(names: set[str]) -> list[str]:
    """Code outside strategies/ that names a strategy: a string constant equal to a name, or an
    f-string starting with one (``f"zero{stage}"``)."""
    found = []
    for module, path in sorted(modules().items()):
        if package_of(module) == "strategies":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                text = str(node.values[0].value)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if text in names or (isinstance(node, ast.JoinedStr) and text in names):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {text!r}")
    return found


def test_imports_run_one_way() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "lower layers import upper ones:\n" + "\n".join(bad)


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_strategies_own_their_names() -> None:
    found = named_strategies(strategy_names())
    assert not found, "strategy names outside parallel_lab/strategies/:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "broken",
    [
        ("models", "parallel_lab.worker.train"),  # a model that knows the loop
        ("comm", "parallel_lab.cli.main"),
    ],
)
def test_the_checks_can_fail(broken: tuple[str, str]) -> None:
    """Each check catches a planted violation (the graph as if one more import existed)."""
    source_package, target = broken
    graph = import_graph()
    source = next(m for m in graph if package_of(m) == source_package)
    graph[source].add(target)
    assert upward_imports(graph)
    graph[target].add(source)
    assert any(source in c and target in c for c in circles(graph))


def test_the_name_check_can_fail() -> None:
    """The baseline's name is written outside strategies/ (the report compares with it): as if it
    were any other strategy's, the check finds it."""
    assert named_strategies({BASELINE})


def print_map() -> None:
    graph = import_graph()
    edges: dict[tuple[str, str], int] = defaultdict(int)
    for source, targets in graph.items():
        for target in targets:
            if package_of(source) != package_of(target):
                edges[package_of(source), package_of(target)] += 1
    for index, members in reversed(list(enumerate(LAYERS))):
        for package in members:
            uses = sorted((b for (a, b) in edges if a == package), key=layer_of, reverse=True)
            print(f"layer {index:2d}  {package:12s} -> {', '.join(uses) or '-'}")
    print(f"upward imports: {len(upward_imports(graph))}; import circles: {len(circles(graph))}")


if __name__ == "__main__":
    print_map()
