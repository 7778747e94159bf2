"""The map of the code, checked: imports run one way (a package imports only packages in lower
layers, or itself; the package root ``parallel_lab/__init__.py`` is checked like any module), no
module takes part in an import circle (imports inside functions count, and so do
``importlib.import_module`` calls: resolved where their target is written in the code, listed in
``DYNAMIC_IMPORTS`` where it comes from outside), outside ``parallel_lab/strategies/`` no code
names a strategy except the baseline ``single``, and docs/architecture.md's layer table is
``LAYERS``.

``python tests/unit/test_layers.py`` prints the layers and every import between packages;
``python tests/unit/test_layers.py --write-docs`` rewrites the table's layer and package columns.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.source import nodes

PACKAGE = Path(__file__).resolve().parents[2] / "parallel_lab"
DOCS = PACKAGE.parent / "docs" / "architecture.md"

# Bottom to top. A package may import its own modules and any package of a lower layer; packages
# in one layer are independent of each other. docs/architecture.md explains each layer.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "errors"),  # the package root (every import runs it: it imports nothing); ConfigError
    ("hashing", "protocol", "plugins", "choices", "threads"),  # records, plugins, typed choices, thread counts
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
IMPORTERS = {"import_module", "__import__", "run_module"}  # importlib's, the builtin, runpy's
# Dynamic imports whose target the code cannot show: (module, the call's argument as written) ->
# (the packages of parallel_lab it may load, why). A new one fails until it is listed here.
DYNAMIC_IMPORTS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("parallel_lab.plugins", "name"): ((), "PARALLEL_LAB_PLUGINS: the user's modules, outside the package"),
    ("parallel_lab.cli.run", "module"): (
        (),
        "a callback: a rank re-imports the module of the function its caller handed run_ranks (target_of), "
        "the caller's own module, so cli depends on nothing new",
    ),
    ("parallel_lab.strategies.zero.strategy", "MUON_MODULE"): ((), "DeepSpeed's own module, outside the package"),
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
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
    resolved = [_known_prefix(name, known) for name in names]
    return [name for name in resolved if name and name != module]


def _known_prefix(name: str, known: dict) -> str | None:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in known else None


def _dynamic_call(node: ast.AST) -> ast.expr | None:
    """The argument of an ``importlib.import_module(...)``-like call, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return node.args[0] if name in IMPORTERS else None


def dynamic_targets(module: str, arg: ast.expr, known: dict) -> list[str] | None:
    """The package's modules a dynamic import may load: a string names one; an f-string
    ``f"{__name__}.{x}"`` or ``f"pkg.{x}"`` any direct module of that package (discovery). None
    when the code does not show the target (it must be on DYNAMIC_IMPORTS)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        found = _known_prefix(arg.value, known)
        return [found] if found else []
    if not isinstance(arg, ast.JoinedStr):
        return None
    parts = []
    for value in arg.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
        elif isinstance(value.value, ast.Name) and value.value.id == "__name__" and not parts:
            parts.append(module)
        else:
            parts.append("{}")
    text = "".join(parts)
    if not (text.endswith(".{}") and text.count("{}") == 1):
        return None
    parent = text[: -len(".{}")]
    return sorted(m for m in known if m.rsplit(".", 1)[0] == parent and m != parent)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at module level, inside functions, or through
    importlib (DYNAMIC_IMPORTS: every module of the packages listed). A discovery loop is an import
    of every module it can reach: ``strategies/__init__.py`` imports each strategy module, which is
    why they import ``register`` from ``strategies/registry.py`` and not from the package root."""
    known = modules(package)
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for node in nodes(path):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_targets(module, node, path.name == "__init__.py", known))
            elif (arg := _dynamic_call(node)) is not None:
                found = dynamic_targets(module, arg, known)
                if found is None:
                    packages = DYNAMIC_IMPORTS.get((module, ast.unparse(arg)), ((), ""))[0]
                    found = [m for m in known if package_of(m) in packages]
                graph[module].update(set(found) - {module})
    return graph


def unlisted_dynamic_imports(package: Path = PACKAGE) -> tuple[list[str], list[tuple[str, str]]]:
    """(dynamic imports whose target the code does not show and DYNAMIC_IMPORTS does not list,
    DYNAMIC_IMPORTS entries no code has any more)."""
    known, unlisted, seen = modules(package), [], set()
    for module, path in sorted(known.items()):
        for node in nodes(path):
            arg = _dynamic_call(node)
            if arg is None or dynamic_targets(module, arg, known) is not None:
                continue
            seen.add((module, ast.unparse(arg)))
            if (module, ast.unparse(arg)) not in DYNAMIC_IMPORTS:
                unlisted.append(f"{path.relative_to(package.parent)}:{node.lineno}: import of {ast.unparse(arg)}")
    return unlisted, sorted(set(DYNAMIC_IMPORTS) - seen) if package == PACKAGE else []


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
            if a != b and layer_of(b) >= layer_of(a):
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
    for node in sorted(set(graph) | {t for targets in graph.values() for t in targets}):
        if node not in index:
            visit(node)
    return found


def strategy_names() -> set[str]:
    """Every registered strategy name, and the family prefix of ZeRO's stages."""
    from parallel_lab.strategies import registered_names

    return {*registered_names(), "zero"} - {BASELINE}


# A Hydra override choosing strategies, inside any string: strategy=zero0, +strategy=dp,ddp, strategy.name=tp
_OVERRIDE = re.compile(r"(?<![\w.])strategy(?:\.name)?=([\w,]+)")


def _string_texts(walked: tuple[ast.AST, ...]):
    """(line, text, is_fstring) of every string in the code, docstrings left out; an f-string's
    text has ``{}`` for each replacement field."""
    docstrings = {
        id(node.body[0].value)
        for node in walked
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    parts_of_fstrings = {id(v) for n in walked if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in walked:
        if isinstance(node, ast.JoinedStr):
            text = "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values)
            yield node.lineno, text, True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings and id(node) not in parts_of_fstrings:
                yield node.lineno, node.value, False


def named_strategies(names: set[str], package: Path = PACKAGE) -> list[str]:
    """Code outside strategies/ that names a strategy: a string equal to a name, an f-string
    starting with one (``f"zero{stage}"``), or an override naming one inside any string
    (``"strategy=zero0"``, ``f"+strategy=dp,{other}"``). Words in prose are not names."""
    found = []
    for module, path in sorted(modules(package).items()):
        if package_of(module) == "strategies":
            continue
        for line, text, fstring in _string_texts(nodes(path)):
            hits = {text} if text in names else set()
            if fstring and text.split("{}", 1)[0] in names:
                hits.add(text.split("{}", 1)[0])
            for match in _OVERRIDE.finditer(text):
                hits.update(name for name in match.group(1).split(",") if name in names)
            found += [f"{path.relative_to(package.parent)}:{line}: {name!r} in {text!r}" for name in sorted(hits)]
    return found


_ROW = re.compile(r"^\| (\d+) \| ([^|]*) \| (.*) \|$")


def docs_table(text: str) -> list[tuple[int, tuple[str, ...], str]]:
    """(layer, packages, what lives there) of every row of the docs' layer table."""
    rows = []
    for line in text.splitlines():
        if match := _ROW.match(line):
            packages = tuple(re.findall(r"`([^`]+)`", match.group(2)))
            rows.append((int(match.group(1)), packages, match.group(3)))
    return rows


def table_differences(text: str) -> list[str]:
    rows = [(layer, packages) for layer, packages, _ in docs_table(text)]
    want = list(enumerate(LAYERS))
    bad = [f"docs: layer {n} {p}; LAYERS: layer {n} {LAYERS[n] if n < len(LAYERS) else '-'}" for n, p in rows]
    bad = [line for line, row in zip(bad, rows) if row not in want]
    bad += [f"LAYERS' layer {n} {p} has no row in the docs" for n, p in want if (n, p) not in rows]
    bad += [f"layer {n}'s row does not say what lives there" for n, _, what in docs_table(text) if not what.strip()]
    return bad


def write_table(text: str) -> str:
    """The docs with the table's layer and package columns rewritten from LAYERS; each row keeps
    the "what lives there" of the row that shared most packages with it."""
    old = docs_table(text)

    def what(members: tuple[str, ...]) -> str:
        shared, best = max(((len(set(members) & set(packages)), what) for _, packages, what in old), default=(0, ""))
        return best if shared else ""

    rows = [f"| {n} | {', '.join(f'`{p}`' for p in members)} | {what(members)} |" for n, members in enumerate(LAYERS)]
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if _ROW.match(line))
    last = max(i for i, line in enumerate(lines) if _ROW.match(line))
    return "\n".join([*lines[:first], *rows, *lines[last + 1 :]]) + "\n"


def test_imports_run_one_way() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "lower layers import upper ones:\n" + "\n".join(bad)


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_dynamic_imports_are_resolved_or_listed() -> None:
    unlisted, stale = unlisted_dynamic_imports()
    assert not unlisted, "dynamic imports the test cannot follow; list them in DYNAMIC_IMPORTS:\n" + "\n".join(unlisted)
    assert not stale, f"DYNAMIC_IMPORTS lists imports no code has any more: {stale}"


def test_strategies_own_their_names() -> None:
    found = named_strategies(strategy_names())
    assert not found, "strategy names outside parallel_lab/strategies/:\n" + "\n".join(found)


def test_the_docs_table_is_layers() -> None:
    bad = table_differences(DOCS.read_text())
    assert not bad, (
        "docs/architecture.md's layer table differs from LAYERS (python tests/unit/test_layers.py "
        "--write-docs):\n" + "\n".join(bad)
    )


@pytest.mark.parametrize(
    "broken",
    [
        ("models", "parallel_lab.worker.train"),  # a model that knows the loop
        ("comm", "parallel_lab.cli.main"),
        ("__init__", "parallel_lab.comm.shm"),  # the package root is checked like any module
    ],
)
def test_the_checks_can_fail(broken: tuple[str, str]) -> None:
    """Each check catches a planted violation (the graph as if one more import existed)."""
    source_package, target = broken
    graph = import_graph()
    source = next(m for m in modules() if package_of(m) == source_package)
    graph[source].add(target)
    assert upward_imports(graph)
    graph[target].add(source)
    assert any(source in c and target in c for c in circles(graph))


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
    if sys.argv[1:] == ["--write-docs"]:
        DOCS.write_text(write_table(DOCS.read_text()))
    else:
        print_map()
