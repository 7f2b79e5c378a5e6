"""The import graph of `gateway/`: lower layers never import upper ones, and no cycles.

Read with `ast` (nothing is imported): every `import`/`from ... import` counts, at module
level or inside a function. Imports under `if TYPE_CHECKING:` do not count for the layers
(a lower layer may name an upper one's type) but do for cycles: two modules that need each
other's names, even only for types, are one concept split in two.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "gateway"

LOWER = ("gateway.harness", "gateway.tokens", "gateway.store", "gateway.policy", "gateway.tools",
         "gateway.providers", "gateway.config", "gateway.local", "gateway.mcp", "gateway.telemetry")
"""Layers below the server: none of them may import the server, the CLI, the demo or the trace view."""
UPPER = ("gateway.server", "gateway.cli", "gateway.demo", "gateway.trace_view")

SERVER_ORDER: dict[str, tuple[str, ...]] = {
    # a package of the server -> the server packages and modules it must not import
    "gateway.server.http": ("gateway.server.runs", "gateway.server.chat", "gateway.server.responses",
                            "gateway.server.embeddings", "gateway.server.api", "gateway.server.console", "gateway.server.app",
                            "gateway.server.main", "gateway.server.openapi"),
    "gateway.server.runs": ("gateway.server.chat", "gateway.server.responses", "gateway.server.embeddings",
                            "gateway.server.api", "gateway.server.console", "gateway.server.app", "gateway.server.main"),
    "gateway.server.chat": ("gateway.server.responses", "gateway.server.embeddings", "gateway.server.api",
                            "gateway.server.console", "gateway.server.app", "gateway.server.main"),
    "gateway.server.responses": ("gateway.server.api", "gateway.server.console", "gateway.server.app", "gateway.server.main"),
    "gateway.server.embeddings": ("gateway.server.api", "gateway.server.console", "gateway.server.app", "gateway.server.main"),
    "gateway.server.api": ("gateway.server.console", "gateway.server.app", "gateway.server.main"),
    "gateway.server.console": ("gateway.server.app", "gateway.server.main"),
    "gateway.server.notify": ("gateway.server.chat", "gateway.server.responses", "gateway.server.embeddings",
                              "gateway.server.api", "gateway.server.console", "gateway.server.app", "gateway.server.main"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: set[str], typing_too: bool = False) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing_too:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gateway"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gateway") and not node.level:
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(typing_too: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: {m for m in _imports(ast.parse(path.read_text()), modules, typing_too) if m != name}
            for name, path in files.items()}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Read when a test of this file runs, not when every pytest worker collects the suite."""
    return _graph()


@pytest.fixture(scope="module")
def typed_graph() -> dict[str, set[str]]:
    """The graph with the imports under `if TYPE_CHECKING:` too."""
    return _graph(typing_too=True)


def test_the_graph_is_read(graph: dict[str, set[str]]) -> None:
    assert "gateway.server.app" in graph and "gateway.server.chat.endpoint" in graph["gateway.server.app"]


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_never_import_upper_ones(layer: str, graph: dict[str, set[str]]) -> None:
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() if _under(module, layer)
                   for target in targets if any(_under(target, upper) for upper in UPPER))
    assert not wrong, wrong


@pytest.mark.parametrize("package", sorted(SERVER_ORDER))
def test_server_packages_import_only_downwards(package: str, graph: dict[str, set[str]]) -> None:
    wrong = sorted(f"{module} imports {target}" for module, targets in graph.items() if _under(module, package)
                   for target in targets if any(_under(target, above) for above in SERVER_ORDER[package]))
    assert not wrong, wrong


def test_no_import_cycles(typed_graph: dict[str, set[str]]) -> None:
    graph = typed_graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    assert not cycles, cycles
