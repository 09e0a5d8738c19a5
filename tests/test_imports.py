"""The package's import graph: no circle, and each layer imports only the layers below it (docs/architecture.md).
Every `import ddpexp.x` / `from ddpexp... import` in src/ddpexp counts, at module level, inside a function (a lazy
import is still a dependency) or under TYPE_CHECKING (a type from a layer above is a dependency on it too)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src" / "ddpexp"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    return imports_of(path.read_text(), modules) - {module_name(path)}


def imports_of(source: str, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return found


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
    assert len(edges) > 30 and "ddpexp.config" in edges["ddpexp.rank.train"]  # the walk sees the package
    assert circle(edges) is None, " -> ".join(circle(edges) or [])


def test_a_circle_would_be_found() -> None:
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None


def test_imports_inside_functions_and_for_types_count() -> None:
    """The four circles cli.command <-> parent.* ran through imports in functions and under TYPE_CHECKING."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ddpexp.cli.command import Command\n"
        "def run():\n    from ddpexp.parent import launch\n    import ddpexp.rank.worker\n"
    )
    modules = {"ddpexp.cli.command", "ddpexp.parent", "ddpexp.parent.launch", "ddpexp.rank.worker"}
    assert imports_of(source, modules) == {"ddpexp.cli.command", "ddpexp.parent", "ddpexp.parent.launch",
                                           "ddpexp.rank.worker"}  # fmt: skip


def test_config_imports_nothing_that_runs() -> None:
    assert graph()["ddpexp.config"] == {"ddpexp.exceptions"}


SHARED = ("ddpexp.config", "ddpexp.exceptions", "ddpexp.job")  # imported by every layer; they import no package
PUBLIC = ("ddpexp.data", "ddpexp.models", "ddpexp.tasks", "ddpexp.optim")  # the documented paths of parts/
# Which layer may import which. The parent hands the ranks' worker to the launcher and reads checkpoints for its
# resume decision (parent -> rank); launchers get the worker as an argument and import no layer; parts import no
# tracker, nor anything of the ranks' side; `testing` is the launcher contract suite, run by a launcher's author.
ALLOWED = {
    "__main__": {"cli"},
    "public": {"parts"},
    "cli": {"cli", "parent", "report"},
    "parent": {"parent", "launchers", "rank", "parts", "trackers", "strategies"},
    "launchers": {"launchers"},
    "trackers": {"trackers"},
    "rank": {"rank", "parts", "trackers", "strategies"},
    "strategies": set(),  # the strategies' config, torch-free; their rank side is rank/ddp.py, rank/fsdp2.py
    "parts": {"parts"},
    "report": {"report"},
    "shared": {"shared"},
    "bench": {"bench", "rank", "parts"},
    "testing": {"cli", "launchers", "trackers"},
}


def layer(module: str) -> str:
    if module in SHARED:
        return "shared"
    if module in PUBLIC:
        return "public"
    return module.split(".")[1] if "." in module else "__init__"


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import a layer may not make, as "importer -> imported"."""
    bad = []
    for module, deps in sorted(edges.items()):
        allowed = ALLOWED[layer(module)] | {"shared"}
        bad += [f"{module} -> {dep}" for dep in sorted(deps) if layer(dep) not in allowed]
    return bad


def test_each_layer_imports_only_the_layers_below_it() -> None:
    edges = graph()
    del edges["ddpexp"]  # the package's __init__: its public names are imported by name on first use
    assert {layer(m) for m in edges} == set(ALLOWED)  # every module is in a layer the rules know
    assert violations(edges) == []


def test_a_broken_layer_rule_would_be_found() -> None:
    edges = {
        "ddpexp.rank.worker": {"ddpexp.cli.api", "ddpexp.parts.data"},  # the ranks' side reaching up
        "ddpexp.launchers.spawn": {"ddpexp.rank.worker"},  # a launcher naming the worker
        "ddpexp.parts.data": {"ddpexp.rank.tracking"},  # a part logging on its own
        "ddpexp.config": {"ddpexp.launchers"},  # a shared module importing a package
        "ddpexp.parent.launch": {"ddpexp.rank.worker", "ddpexp.config"},  # allowed
    }
    assert violations(edges) == [
        "ddpexp.config -> ddpexp.launchers",
        "ddpexp.launchers.spawn -> ddpexp.rank.worker",
        "ddpexp.parts.data -> ddpexp.rank.tracking",
        "ddpexp.rank.worker -> ddpexp.cli.api",
    ]


def test_shared_modules_import_no_package() -> None:
    edges = graph()
    assert {d for m in SHARED for d in edges[m]} <= set(SHARED)
