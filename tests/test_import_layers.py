"""The package's import graph has no cycles, and tools sit on top of the library.

The graph is read from the source (every `import` and `from ... import`, including those
inside functions and under `if TYPE_CHECKING:`), so a cycle hidden in a lazy import
counts too. A module importing its own package's `__init__` is not an edge of its own.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "tba_jax"


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """{dotted module name: file} for every .py file under root/package."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (file `path`) imports."""
    is_package = path.name == "__init__.py"
    package_parts = name.split(".") if is_package else name.split(".")[:-1]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from a.b import c` imports the module a.b.c when there is one, else a.b.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        else:
            continue
        imported.update(target for target in targets if target in known and target != name)
    return imported


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    names = module_names(root, package)
    known = set(names)
    return {name: imported_modules(name, path, known) for name, path in names.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan): the sets of
    modules that each reach one another through imports. Sorted names, one list each."""
    index, lowlink, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                lowlink[node] = min(lowlink[node], lowlink[successor])
            elif successor in on_stack:
                lowlink[node] = min(lowlink[node], index[successor])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed import path per circle (its first module repeated at the end)."""
    return [closed_path(graph, set(circle)) for circle in import_circles(graph)]


def closed_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One cycle inside `component` (a breadth-first path from its first module back)."""
    start = min(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & component):
                if successor == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if successor not in parents:
                    parents[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_package_has_no_import_cycles():
    graph = import_graph(REPO_ROOT, PACKAGE)
    described = [
        f"{len(circle)} modules {circle}, e.g. {' -> '.join(closed_path(graph, set(circle)))}"
        for circle in import_circles(graph)
    ]
    assert not described, "import circles:\n" + "\n".join(described)


def test_the_library_never_imports_the_launchers_or_the_training_loop_from_below():
    graph = import_graph(REPO_ROOT, PACKAGE)
    readers = {"tba_jax.runs", "tba_jax.evaluation"}
    for name in readers:
        assert "tba_jax.train" not in graph.get(name, ()), f"{name} imports the training loop"
    for name, imported in graph.items():
        if name.startswith("tba_jax.models"):
            outside = {m for m in imported if not m.startswith("tba_jax.models")}
            assert not outside, f"{name} reaches above models/: {sorted(outside)}"


def write_package(root: pathlib.Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from pkg.sub import c\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from ..a import x\n",
            "pkg/d.py": "import pkg.a\n",
        },
    )
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


@pytest.mark.parametrize(
    "text", ["from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"]
)
def test_a_type_checking_import_counts(tmp_path, text):
    write_package(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": text})
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]
