"""The package's import graph has no circle: every `import ddpexp.x` / `from ddpexp... import` in src/ddpexp, at
module level or inside a function (a lazy import is still a dependency), except those under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src" / "ddpexp"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    type_checking = {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
        for n in ast.walk(node)
    }  # fmt: skip
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return found - {module_name(path)}


def graph() -> dict[str, set[str]]:
    paths = sorted(SRC.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    edges = {module_name(p): imports(p, modules) for p in paths}
    for name in modules:  # importing ddpexp.a.b runs ddpexp.a's __init__ first: that is not a dependency of it
        edges[name] = {d for d in edges[name] if not name.startswith(f"{d}.")} - {"ddpexp"}
    return edges


def circle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_circle() -> None:
    edges = graph()
    assert len(edges) > 30 and "ddpexp.config" in edges["ddpexp.train"]  # the walk sees the package
    assert circle(edges) is None, " -> ".join(circle(edges) or [])


def test_a_circle_would_be_found() -> None:
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None


def test_config_imports_nothing_that_runs() -> None:
    assert graph()["ddpexp.config"] == {"ddpexp.exceptions"}
