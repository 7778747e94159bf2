"""Module-level state that steers control flow, checked: no ``global`` statement anywhere in
``parallel_lab/``, and no module-level object (a name bound at a module's top level by an
assignment or a class statement) is changed from inside a function, except the few on
``ALLOWED``, each with the reason it lives in the module. docs/architecture.md states the list.

Changed means: an item or attribute of it assigned or deleted (``_cache["link"] = ...``,
``_STATE.pid = ...``), a mutating method called on it (``.append``, ``.update``, ``.clear``, ...)
or ``setattr`` on it, from a function where the name is not a local.

``python tests/unit/test_module_state.py`` prints every changed module-level name and where.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.unit.test_layers import modules  # one walk of the package, shared with the layer check

PACKAGE = Path(__file__).resolve().parents[2] / "parallel_lab"

# (module, name) -> why this state lives in the module. Keep it short: a new entry needs a reason
# a reader accepts, and the same line in docs/architecture.md.
ALLOWED: dict[tuple[str, str], str] = {
    ("parallel_lab.strategies.registry", "_REGISTRY"): "the registry: @register fills it at import, once per class",
    ("parallel_lab.strategies.registry", "_RULES"): "the rules' registry: @register_rules fills it at import, once",
    ("parallel_lab.strategies.fsdp.strategy", "FSDPStrategy"): (
        "its _by_version registry: each FSDP version's class adds itself when it is defined"
    ),
    ("parallel_lab.comm.shm", "_links"): (
        "the shm ring's mapped inboxes, set up collectively once per default process group (a resource "
        "that lives as long as the group does, like torch.distributed's own default group)"
    ),
    ("parallel_lab.worker.zygote", "_zygote"): (
        "the pid and environment of multiprocessing's fork server, itself one per process: a changed "
        "import-time environment starts a new one"
    ),
    ("parallel_lab.config.compose", "_stored"): (
        "what was last stored in Hydra's ConfigStore, itself one per process: storing the same again "
        "is skipped (~0.2 s a call)"
    ),
    ("parallel_lab.config.compose", "_MEMO"): (
        "the compositions of this process, each keyed by all that decides it: the same compose again "
        "is a copy (~3 ms against ~0.2 s)"
    ),
}
MUTATORS = {
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault",
    "add", "discard", "sort", "reverse", "__setitem__", "__delitem__",
}  # fmt: skip


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level by assignment or class (imports and functions left out)."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                pending.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            pending.extend(node.body)
    return names


def _root(node: ast.expr) -> str | None:
    """The name an item/attribute chain starts from (``a`` of ``a.b[c].d``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _own_nodes(function: ast.AST):
    """The nodes of a function's body, its nested functions and classes left out (seen on their own)."""
    pending = list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))


def _locals(function: ast.AST) -> set[str]:
    args = function.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    names = {a.arg for a in params if a is not None}
    for node in _own_nodes(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _changed(node: ast.AST) -> list[str]:
    """Root names a statement/expression changes in place."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.Call):  # the object a method changes, or setattr's first argument
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            return [name for name in [_root(func.value)] if name]
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            return [name for name in [_root(node.args[0])] if name]
    flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    return [name for t in flat if isinstance(t, (ast.Attribute, ast.Subscript)) and (name := _root(t))]


def findings(files: dict[str, Path]) -> tuple[list[str], dict[tuple[str, str], list[str]]]:
    """(every ``global`` statement, (module, name) -> where a module-level name is changed)."""
    globals_found: list[str] = []
    changed: dict[tuple[str, str], list[str]] = {}
    for module, path in sorted(files.items()):
        parts = path.parts
        where = "/".join(parts[len(parts) - 1 - parts[::-1].index(module.split(".")[0]) :])
        found, changes = _file_findings(path.read_text(), where)
        globals_found += found
        for name, lines in changes.items():
            changed[(module, name)] = lines
    return globals_found, changed


@functools.lru_cache(maxsize=None)  # three tests read the same package: each text is walked once
def _file_findings(text: str, where: str) -> tuple[list[str], dict[str, list[str]]]:
    tree = ast.parse(text, where)
    top = _top_level_names(tree)
    globals_found: list[str] = []
    changed: dict[str, list[str]] = {}
    for function in ast.walk(tree):
        if isinstance(function, ast.Global):
            globals_found.append(f"{where}:{function.lineno}: global {', '.join(function.names)}")
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        local = _locals(function)
        for node in _own_nodes(function):
            for name in _changed(node):
                if name in top and name not in local:
                    lines = changed.setdefault(name, [])
                    lines += [] if f"{where}:{node.lineno}" in lines else [f"{where}:{node.lineno}"]
    return globals_found, changed


def violations(files: dict[str, Path]) -> list[str]:
    globals_found, changed = findings(files)
    bad = [f"{line} (pass the state explicitly, or hold it in an object on ALLOWED)" for line in globals_found]
    for (module, name), lines in sorted(changed.items()):
        if (module, name) not in ALLOWED:
            bad.append(f"{lines[0]}: module-level '{name}' of {module} is changed in a function (not on ALLOWED)")
    return bad


def test_no_module_state_steers_control_flow() -> None:
    bad = violations(modules())
    assert not bad, "module-level state outside ALLOWED in tests/unit/test_module_state.py:\n" + "\n".join(bad)


def test_the_allow_list_is_current() -> None:
    """Every entry still names state that exists and is changed: a removed one leaves the list."""
    _, changed = findings(modules())
    stale = sorted(set(ALLOWED) - set(changed))
    assert not stale, f"ALLOWED names state no function changes any more: {stale}"


def test_the_docs_state_the_allow_list() -> None:
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [f"{m}.{n}" for m, n in ALLOWED if f"`{m.removeprefix('parallel_lab.')}.{n}`" not in text]
    assert not missing, f"docs/architecture.md does not name the allowed module state: {missing}"


PLANTED = {
    "global": "_flag = False\n\ndef set_flag():\n    global _flag\n    _flag = True\n",
    "item": "_cache: dict = {}\n\ndef remember(key, value):\n    _cache[key] = value\n",
    "method": "_seen = []\n\ndef see(value):\n    _seen.append(value)\n",
    "attribute": "class _State:\n    pid = None\n\n_state = _State()\n\ndef start(pid):\n    _state.pid = pid\n",
    "setattr": "import types\n_ns = types.SimpleNamespace()\n\ndef put(v):\n    setattr(_ns, 'v', v)\n",
    "nested": "_hits = {}\n\ndef outer():\n    def inner():\n        _hits.update(a=1)\n    return inner\n",
}


def test_the_check_can_fail(tmp_path: Path) -> None:
    """Each planted kind of module state is caught; the same shapes on a local are not."""
    package = tmp_path / "parallel_lab"
    package.mkdir()
    for kind, source in PLANTED.items():
        (package / f"{kind}.py").write_text(source)
    (package / "local.py").write_text("_cache = {}\n\ndef f():\n    _cache = {}\n    _cache['a'] = 1\n")
    bad = violations(modules(package))
    for kind in PLANTED:
        assert any(f"parallel_lab/{kind}.py" in line for line in bad), (kind, bad)
    assert not any("local.py" in line for line in bad), bad


if __name__ == "__main__":
    for (module, name), lines in sorted(findings(modules())[1].items()):
        print(f"{module}.{name}: {'allowed' if (module, name) in ALLOWED else 'NOT ALLOWED'} ({', '.join(lines)})")
    print("\n".join(findings(modules())[0]))
