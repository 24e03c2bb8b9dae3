"""The packages import one way, deploy -> connectors -> kvpp_core (inside deploy: cli -> harness ->
services -> deployment -> args), no module imports itself back, and no folder does either (inside
connectors: the plugin's composition -> each connector -> what they share in common/).

Every import statement counts, those inside functions included (they run when the function does);
imports under `if TYPE_CHECKING:` are left out, since they never run. A package's implicit import of
its parent package is not an edge: Python initialises the parent first, whatever it imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit

ORDER = ("deploy", "connectors", "kvpp_core")
"""Each package may import only those after it."""
DEPLOY_LAYERS = ("cli", "harness", "services", "deployment", "args")
"""Inside deploy, each layer may import its own modules and those of the layers after it."""


def _modules() -> dict[str, Path]:
    found = {}
    for package in ORDER:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The names of the modules `tree` imports (a `from m import x` imports m.x when that is a module)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        imported = _imported(ast.parse(path.read_text(encoding="utf-8")), module, path.name == "__init__.py")
        # `import a.b.c` needs a.b.c; only the most specific project module a name reaches is an edge.
        edges = set()
        for name in imported:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


GRAPH = _graph()


def _package(module: str) -> str:
    return module.partition(".")[0]


def test_the_walk_sees_every_package_and_its_imports():
    assert {_package(m) for m in MODULES} == set(ORDER)
    assert "kvpp_core.config" in GRAPH["connectors.store.settings"]
    assert "kvpp_core.setup" in GRAPH["kvpp_core.startup"]


def test_no_package_imports_one_above_it():
    upward = sorted(f"{module} -> {target}" for module, targets in GRAPH.items() for target in targets
                    if ORDER.index(_package(target)) < ORDER.index(_package(module)))
    assert upward == [], "imports that run upward (deploy -> connectors -> kvpp_core):\n" + "\n".join(upward)


def _deploy_layer(module: str) -> int | None:
    parts = module.split(".")
    return DEPLOY_LAYERS.index(parts[1]) if parts[0] == "deploy" and len(parts) > 1 else None


def test_no_deploy_layer_imports_one_above_it():
    upward = sorted(f"{module} -> {target}" for module, targets in GRAPH.items() for target in targets
                    if _deploy_layer(module) is not None and _deploy_layer(target) is not None
                    and _deploy_layer(target) < _deploy_layer(module))
    assert upward == [], f"deploy imports that run upward ({' -> '.join(DEPLOY_LAYERS)}):\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _a_cycle_through(component: list[str], graph: dict[str, set[str]] = GRAPH) -> list[str]:
    """One import path from the component's first node back to itself, to show in the failure."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                frontier.append(target)
    raise AssertionError(f"{component} is not a cycle")


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ORDER)
def test_no_import_cycle(package):
    cycles = [c for c in _cycles(GRAPH) if _package(c[0]) == package]
    shown = "\n".join(" -> ".join(_a_cycle_through(c)) + f"  (modules {', '.join(c)})" for c in cycles)
    assert cycles == [], f"import cycles in {package}:\n{shown}"


def _folder(module: str) -> str:
    """The folder a module lies in, dotted (`connectors.store.backends` for its `__init__` and its modules)."""
    return ".".join(MODULES[module].relative_to(REPO).parent.parts)


def _folder_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """The import graph contracted to folders, and one module edge behind each folder edge."""
    graph: dict[str, set[str]] = {_folder(m): set() for m in MODULES}
    witness = {}
    for module, targets in sorted(GRAPH.items()):
        for target in sorted(targets):
            edge = (_folder(module), _folder(target))
            if edge[0] != edge[1]:
                graph[edge[0]].add(edge[1])
                witness.setdefault(edge, f"{module} -> {target}")
    return graph, witness


def test_no_import_loop_between_folders():
    graph, witness = _folder_graph()
    assert {"connectors", "connectors.common", "connectors.mooncake", "connectors.store",
            "connectors.store.backends", "kvpp_core", "deploy", "deploy.cli"} <= set(graph)
    assert "connectors.common" in graph["connectors.mooncake"] and "connectors.mooncake" in graph["connectors"]
    shown = []
    for component in _cycles(graph):
        path = _a_cycle_through(component, graph)
        shown.append(" -> ".join(path) + f"  (folders {', '.join(component)})\n"
                     + "\n".join(f"  {witness[edge]}" for edge in zip(path, path[1:])))
    assert shown == [], "import loops between folders:\n" + "\n".join(shown)
