"""No import circles in the engine, the lab or the plugin: the graph of which module imports
which, drawn from the source, has no cycle. Every import counts, also those inside functions and
under `if TYPE_CHECKING:` (an import moved there still ties the two modules together; it only
hides the circle from the interpreter).

Not counted: a module's own package `__init__` (Python imports the parents of a module first, so
a package that assembles its modules is not a circle with them), and modules named in strings
and loaded through a registry (the plugin manager's built-in plugins, the CLI's command
modules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folders of the import package `expert_stream` (pyproject's package-dir).
FOLDERS = {"plugin/package_root": "expert_stream", "plugin": "expert_stream.plugin",
           "streaming": "expert_stream.streaming", "native": "expert_stream.native"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    for folder, package in FOLDERS.items():  # package_root before plugin
        if rel.is_relative_to(folder):
            parts = [package, *rel.relative_to(folder).parts]
            break
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for folder in ("plugin", "streaming", "native"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `path` imports anywhere in its source, relative imports resolved; in a
    folder of scripts (no __init__.py) a bare `import x` is the sibling x.py."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    scripts = not (path.parent / "__init__.py").exists()
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                sibling = ".".join([*package, alias.name])
                found.add(sibling if scripts and sibling in known else alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if scripts and not node.level and f"{'.'.join(package)}.{module}" in known:
                module = f"{'.'.join(package)}.{module}"
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return {m for m in found if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the package is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, component) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to the start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_the_graph_sees_hidden_imports(tmp_path):
    """Imports inside functions and under TYPE_CHECKING are edges (the test would pass
    vacuously if they were not), and a cycle is named module by module."""
    (tmp_path / "__init__.py").write_text("")
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
                      "def f():\n    from pkg import c\n    import pkg.d\n")
    known = {f"pkg.{m}": tmp_path / f"{m}.py" for m in "abcde"}
    assert imports("pkg.a", source, known) == {"pkg.b", "pkg.c", "pkg.d"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}}
    assert cycles(graph) == [["d", "e", "d"], ["a", "b", "c", "a"]]


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found = [" -> ".join(m.removeprefix("expert_stream.") for m in cycle) for cycle in cycles(graph)]
    assert not found, "import circles: " + "; ".join(found)
