"""The code's layering rules, checked on the source (AST), so a change that breaks one fails CI:

- ``async_vla/`` is library code: it imports neither ``actors`` nor ``learner`` and starts no process;
- ``actors/`` and ``learner/`` import the library, never each other;
- no import cycles among the modules of ``async_vla/``, ``actors/``, ``learner/`` and ``runner/`` (every import
  counts: lazy ones inside functions and ``TYPE_CHECKING`` ones too);
- no module-level mutable state: no ``global`` statement, and a module-level dict/list/set is a constant table
  that nothing mutates;
- and, as a report rather than a rule: files past ~500 lines are listed (a prompt to look whether a file holds
  more than one responsibility; never a reason to cut a concern in two).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("async_vla", "actors", "learner")
ACYCLIC = (*PACKAGES, "runner")
# Cycles allowed for now (none): an entry that no longer exists fails the test too.
KNOWN_CYCLES: list[set[str]] = []
LONG_FILE_LINES = 500   # reported, not enforced
# How a module starts a process: the modules themselves, and the os calls that do it.
PROCESS_MODULES = {"subprocess", "multiprocessing", "concurrent.futures.process"}
PROCESS_CALLS = {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp",
                 "execvpe", "execl", "execlp", "spawnv", "spawnve", "spawnl", "spawnlp"}
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "remove",
            "discard", "__setitem__"}


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.Module) -> set[str]:
    """Every module name imported anywhere in the file (lazy imports inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _top(name: str) -> str:
    return name.split(".")[0]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_packages_exist_and_are_scanned():
    # guards the tests below against passing on an empty file list (a moved directory)
    for package in PACKAGES:
        assert len(_modules(package)) >= 3, package


@pytest.mark.parametrize("package, forbidden", [("async_vla", {"actors", "learner"}),
                                                ("actors", {"learner"}), ("learner", {"actors"})])
def test_packages_import_only_downward(package, forbidden):
    bad = [f"{_rel(p)} imports {name}" for p in _modules(package) for name in sorted(_imports(_tree(p)))
           if _top(name) in forbidden]
    assert not bad, "layering: " + "; ".join(bad)


def test_the_library_starts_no_process():
    bad = []
    for path in _modules("async_vla"):
        tree = _tree(path)
        bad += [f"{_rel(path)} imports {name}" for name in sorted(_imports(tree))
                if name in PROCESS_MODULES or any(name.startswith(m + ".") for m in PROCESS_MODULES)]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
                    and node.func.attr in PROCESS_CALLS):
                bad.append(f"{_rel(path)}:{node.lineno} calls os.{node.func.attr}")
    assert not bad, "async_vla/ is library code that never starts a process (move it to actors/, learner/ or " \
                    "bin/): " + "; ".join(bad)


def _module_tables(tree: ast.Module) -> set[str]:
    """Names bound at module level to a dict/list/set display or comprehension (``__all__`` aside)."""
    tables = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            tables.update(t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__")
    return tables


def _mutations(tree: ast.Module, names: set[str]) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            lines += [node.lineno for t in targets
                      if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
              and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
            lines.append(node.lineno)
    return lines


def test_no_module_level_mutable_state():
    bad = []
    for package in PACKAGES:
        for path in _modules(package):
            tree = _tree(path)
            bad += [f"{_rel(path)}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(tree)
                    if isinstance(n, ast.Global)]
            bad += [f"{_rel(path)}:{line} mutates a module-level table"
                    for line in _mutations(tree, _module_tables(tree))]
    assert not bad, "module-level mutable state (keep it on an object): " + "; ".join(bad)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages: tuple[str, ...] = ACYCLIC) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (``from a.b import c`` counts as a.b.c when that is a
    module, else as a.b; a package's ``__init__`` is its own node)."""
    paths = {_module_name(p): p for package in packages for p in _modules(package)}

    def owner(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                found.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(owner(f"{node.module}.{alias.name}") for alias in node.names)
        graph[name] = {m for m in found if m is not None and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan), each an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, ("import cycles (move what both sides need into a module that imports neither, or the "
                     f"builder out of the interface module): {new}")
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"these allowed cycles no longer exist: delete them from KNOWN_CYCLES: {gone}"


def test_the_checks_above_catch_what_they_look_for():
    # the detectors themselves, on a snippet that breaks every rule
    tree = ast.parse("import subprocess\nfrom learner.core import X\nT = {}\n"
                     "def f():\n    global G\n    T['a'] = 1\n    T.update(b=2)\n    os.fork()\n")
    assert {"subprocess", "learner.core"} <= _imports(tree)
    assert _module_tables(tree) == {"T"} and _mutations(tree, {"T"}) == [6, 7]
    assert any(isinstance(n, ast.Global) for n in ast.walk(tree))
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [{"a", "b", "c"}]
    graph = import_graph()
    assert graph["runner.launch"] >= {"runner.commands", "async_vla.config"} and "async_vla" not in graph["actors"]


def long_files(limit: int = LONG_FILE_LINES) -> list[str]:
    """Source files past ``limit`` lines, longest first, as "path (n lines)"."""
    files = [p for package in (*PACKAGES, "benchmarks", "runner", "tests") for p in _modules(package)]
    files += [p for p in (REPO / "bin").iterdir() if p.is_file() and p.read_text(errors="replace").startswith(
        "#!/usr/bin/env python")]
    sizes = sorted(((len(p.read_text().splitlines()), p) for p in files), key=lambda x: (-x[0], str(x[1])))
    return [f"{_rel(p)} ({n} lines)" for n, p in sizes if n > limit]


def test_long_files_are_reported_not_failed():
    # A report: run pytest -ra (bin/test does) to see the list in the warnings summary.
    long = long_files()
    if long:
        warnings.warn(f"files past {LONG_FILE_LINES} lines (look whether each holds one responsibility): "
                      + "; ".join(long), stacklevel=1)
    assert long_files(limit=0), "the size report scanned no file"
