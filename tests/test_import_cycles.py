"""No import circles: within ``mxfp8_ep``, and within ``launch``, no module imports, directly or
through others, a module that imports it, counting imports made inside functions too (a deferred
import hides a circle, it does not remove it). A circle fails the test, which lists its modules.
And both packages only import downward through their layers (``launch.LAYERS``,
``mxfp8_ep.LAYERS``, lowest first): an import from a subpackage into one above it, or into a
module above every layer (``launch/train.py``, ``mxfp8_ep/titan030.py``), fails the test, which
names the import. ``mxfp8_ep`` keeps at most six modules at its top beside its subpackages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mxfp8_ep
from launch import LAYERS

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


def layer_of(module: str, layers: tuple[str, ...]) -> int:
    """Where a module of ``launch`` or ``mxfp8_ep`` sits: its subpackage's (or, for a module at
    the package's top, its own) place in ``layers``; the modules at the top that ``layers`` does
    not name (``launch.train``, ``mxfp8_ep.elastic``) and the package itself sit above every
    layer."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in layers):
        return layers.index(parts[1])
    return len(layers)


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[tuple[str, str]]:
    """(importer, imported) for every import between two parts of a package that goes up."""
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if layer_of(b, layers) > layer_of(a, layers))


def test_the_layer_scan_finds_an_upward_import():
    graph = {"launch.run.console": {"launch.titan.metrics", "launch.config.problems"},
             "launch.titan.metrics": {"launch.run.console"}, "launch.titan.data": {"launch.train"},
             "launch.train": {"launch.titan.data"}}
    assert upward_imports(graph, ("config", "run", "titan")) == [
        ("launch.run.console", "launch.titan.metrics"), ("launch.titan.data", "launch.train")]
    assert upward_imports(graph, ("config", "titan", "run")) == [
        ("launch.titan.data", "launch.train"), ("launch.titan.metrics", "launch.run.console")]


def test_every_launch_subpackage_has_a_layer():
    assert sorted(p.parent.name for p in (ROOT / "launch").glob("*/__init__.py")) == sorted(LAYERS)


def test_launch_imports_only_go_down_its_layers():
    graph = import_graph("launch")
    assert {"launch.preflight.validate", "launch.titan.runner", "launch.train"} <= set(graph)
    assert upward_imports(graph, LAYERS) == []


def test_the_layer_scan_places_the_modules_at_mxfp8_eps_top():
    graph = {"mxfp8_ep.format.mxfp8": {"mxfp8_ep.config"}, "mxfp8_ep.config": {"mxfp8_ep.format.wire_format"},
             "mxfp8_ep.exchange.staging": {"mxfp8_ep.elastic"}, "mxfp8_ep.elastic": {"mxfp8_ep.pool.activation_pool"}}
    assert upward_imports(graph, ("format", "config", "exchange", "pool")) == [
        ("mxfp8_ep.exchange.staging", "mxfp8_ep.elastic"), ("mxfp8_ep.format.mxfp8", "mxfp8_ep.config")]


def test_every_mxfp8_ep_part_has_a_layer():
    top = ROOT / "mxfp8_ep"
    subpackages = {p.parent.name for p in top.glob("*/__init__.py")}
    assert subpackages <= set(mxfp8_ep.LAYERS)
    assert set(mxfp8_ep.LAYERS) - subpackages <= {p.stem for p in top.glob("*.py")}


def test_mxfp8_ep_keeps_six_modules_at_its_top():
    assert len([p for p in (ROOT / "mxfp8_ep").glob("*.py") if p.name != "__init__.py"]) <= 6


def test_mxfp8_ep_imports_only_go_down_its_layers():
    graph = import_graph("mxfp8_ep")
    assert {"mxfp8_ep.format.mxfp8", "mxfp8_ep.dispatcher.symm", "mxfp8_ep.titan030"} <= set(graph)
    assert upward_imports(graph, mxfp8_ep.LAYERS) == []
