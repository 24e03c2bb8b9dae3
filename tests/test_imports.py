"""The packages import one way, testbed -> deploy -> connectors -> kvpp_core (inside deploy: cli -> harness ->
services -> deployment -> bounds), no module imports itself back and no folder imports itself back through
another (inside connectors: the plugin's composition -> each connector -> what they share in common/);
command lines are parsed only in deploy/cli/ and bench/.

Every import statement counts, those inside functions included (they run when the function does);
imports under `if TYPE_CHECKING:` are left out, since they never run. A package's implicit import of
its parent package is not an edge: Python initialises the parent first, whatever it imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit

ORDER = ("testbed", "deploy", "connectors", "kvpp_core")
"""Each package may import only those after it (testbed, not installed, drives the others for tests and
benchmarks; nothing installed imports it)."""
DEPLOY_LAYERS = ("cli", "harness", "simulation", "services", "deployment", "bounds")
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
    assert "deploy.services.processes" in GRAPH["testbed.engine"]
    assert "deploy.cli.proxy" in GRAPH["deploy.cli.main"]  # the subcommands are imported, not named


def test_no_package_imports_one_above_it():
    upward = sorted(f"{module} -> {target}" for module, targets in GRAPH.items() for target in targets
                    if ORDER.index(_package(target)) < ORDER.index(_package(module)))
    assert upward == [], f"imports that run upward ({' -> '.join(ORDER)}):\n" + "\n".join(upward)


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


def _a_cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
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
    shown = "\n".join(" -> ".join(_a_cycle_through(c, GRAPH)) + f"  (modules {', '.join(c)})" for c in cycles)
    assert cycles == [], f"import cycles in {package}:\n{shown}"


def _folder(module: str) -> str:
    """The folder that holds a module's file (a package's own folder for its __init__.py)."""
    return MODULES[module].parent.relative_to(REPO).as_posix()


def _folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        edges = graph.setdefault(_folder(module), set())
        edges.update(_folder(t) for t in targets if _folder(t) != _folder(module))
    return graph


FOLDER_GRAPH = _folder_graph()


def test_the_folder_graph_contracts_modules_to_their_folders():
    assert {"connectors", "connectors/mooncake", "connectors/store/backends", "deploy", "deploy/cli",
            "testbed"} <= set(FOLDER_GRAPH)
    assert "deploy/services" in FOLDER_GRAPH["deploy/cli"] and "deploy/cli" not in FOLDER_GRAPH["deploy/cli"]


def test_no_folder_imports_itself_back():
    cycles = _cycles(FOLDER_GRAPH)
    shown = "\n".join(" -> ".join(_a_cycle_through(c, FOLDER_GRAPH)) + f"  (folders {', '.join(c)})" for c in cycles)
    assert cycles == [], f"import loops between folders:\n{shown}"


ARGPARSE_FREE = ("deploy", "connectors", "kvpp_core", "testbed", "tests/helpers")
"""Where no module parses a command line: drivers started as processes take a typed job instead."""
COMMAND_LINES = ("deploy/cli",)
"""The one folder of these that parses command lines (bench/, outside them, does too)."""


def test_no_module_outside_the_command_line_folders_imports_argparse():
    found = []
    for root in ARGPARSE_FREE:
        for path in sorted((REPO / root).rglob("*.py")):
            where = path.relative_to(REPO).as_posix()
            if where.startswith(tuple(f"{folder}/" for folder in COMMAND_LINES)):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{where}:{node.lineno}" for name in names if name.partition(".")[0] == "argparse"]
    assert found == [], "argparse imported outside deploy/cli/ and bench/:\n" + "\n".join(found)
