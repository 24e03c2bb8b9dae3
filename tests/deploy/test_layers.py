"""deploy's packages import one way, cli -> harness -> services -> deployment -> args, without cycles."""

import ast

import pytest

from tests.helpers.paths import REPO

LAYERS = ("args", "deployment", "services", "harness", "cli")
"""Lowest first: a module may import its own layer's modules and lower ones."""


def _imports() -> dict[str, set[str]]:
    """deploy module -> the deploy modules it imports (at any depth of its code)."""
    graph = {}
    for path in (REPO / "deploy").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deploy"):
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("deploy")}
        graph[module] = found
    return {m: {i for i in found if i in graph and i != m and i != "deploy"} for m, found in graph.items()}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1]) if module.count(".") else -1


@pytest.mark.unit
def test_no_module_imports_a_higher_layer():
    upward = [f"{m} -> {i}" for m, found in _imports().items() for i in found
              if _layer(m) >= 0 and _layer(i) > _layer(m)]
    assert upward == []


@pytest.mark.unit
def test_no_import_cycles():
    graph, cycles, done = _imports(), [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []
