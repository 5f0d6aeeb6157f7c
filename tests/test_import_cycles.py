"""No import circles: within ``mxfp8_ep``, and within ``launch``, no module imports, directly or
through others, a module that imports it, counting imports made inside functions too (a deferred
import hides a circle, it does not remove it). A circle fails the test, which lists its modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (anywhere in its code). ``from a import
    b`` counts as importing ``a.b`` when that is a module, else ``a``."""
    paths = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in paths and t != name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_scan_finds_circles_through_deferred_imports():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert import_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_dispatcher_imports_are_read_with_their_targets():
    graph = import_graph("mxfp8_ep")
    assert "mxfp8_ep.dispatcher.base" in graph["mxfp8_ep.dispatcher.push"]
    assert "mxfp8_ep.dispatcher.push" in graph["mxfp8_ep.dispatcher.symm"]


@pytest.mark.parametrize("package", ["mxfp8_ep", "launch"])
def test_no_import_cycles(package):
    assert import_cycles(import_graph(package)) == []
