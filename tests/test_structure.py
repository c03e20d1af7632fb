"""The package's layout, read from its source (ast; nothing is imported): each room imports only
what stands below it, and no room grows past ``MAX_LINES``.

An import counts wherever it is written: at the top, inside a function, or under
``if TYPE_CHECKING:``. Any of them joins two rooms, and a circle of them is a house where no
room can be read, tested or moved without the others.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "elastic_mnist"
MAX_LINES = 500
"""The most lines a module of the package may have."""


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The package's modules that module ``name`` imports, anywhere in it, with the line: for
    ``from a.b import c``, ``a.b.c`` where that is a module, else ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # import a.b.c of a package: its nearest
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """For each module, the modules of the package it imports, and the first line that does."""
    known = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges = graph.setdefault(name, {})
        for target, line in imported(name, path, known):
            edges.setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected part of ``graph`` of more than one module, with one shortest
    circle in it as a path that ends where it starts (Tarjan's components, then a breadth-first
    search in each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []

    def connect(start: str) -> None:  # iterative: no recursion limit to meet
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        parts.append(sorted(part))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    return [(part, shortest_circle(graph, part)) for part in parts]


def shortest_circle(graph: dict[str, dict[str, int]], part: list[str]) -> list[str]:
    """The shortest path from ``part``'s first module back to it, within ``part``."""
    start, inside = part[0], set(part)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target in inside and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle in {part}")  # a component of two or more has one


def short(module: str) -> str:
    return module.removeprefix("elastic_mnist.")


def test_no_circle_of_imports():
    """No module imports, however indirectly, a module that imports it."""
    graph = import_graph()
    found = circles(graph)
    lines = []
    for part, circle in found:
        steps = ", ".join(f"{short(a)} line {graph[a][b]}" for a, b in pairwise(circle))
        lines.append(f"{' → '.join(map(short, circle))} (imported at: {steps}; the circles "
                     f"join {', '.join(map(short, part))})")
    assert not found, "circles of imports in elastic_mnist:\n" + "\n".join(lines)


def test_no_module_over_the_most_lines():
    """No module of the package is longer than MAX_LINES: a longer one holds more than one job."""
    over = [f"{path.relative_to(PACKAGE.parent)}: {length} lines"
            for path in modules().values()
            if (length := len(path.read_text().splitlines())) > MAX_LINES]
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(over)


def test_the_check_sees_every_kind_of_import(tmp_path, monkeypatch):
    """Imports inside functions, under TYPE_CHECKING, relative ones, and ``from a import b`` of
    a submodule b all count, and a circle is named as a path from a module back to it."""
    package = tmp_path / "elastic_mnist"
    (package / "sub").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from elastic_mnist.b import Thing\n",
        "b.py": "def late():\n    from elastic_mnist.sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import x\n",
        "d.py": "import elastic_mnist.sub.c\nfrom elastic_mnist import a\n",
    }.items():
        (package / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph = import_graph()
    assert graph["elastic_mnist.d"] == {"elastic_mnist.sub.c": 1, "elastic_mnist.a": 2}
    part = ["elastic_mnist.a", "elastic_mnist.b", "elastic_mnist.sub.c"]
    assert circles(graph) == [(part, [*part, "elastic_mnist.a"])]
