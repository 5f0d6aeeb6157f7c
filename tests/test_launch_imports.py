"""launch/ has no import circles: every ``import launch.x`` / ``from launch.x import`` in a module
(at any depth: imports inside functions and under TYPE_CHECKING count, they only hide a
circle) points down a graph without cycles. The launchers and the validator meet in the
interface modules (launch/launcher.py, launch/problems.py), never in each other."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.hydra_compose import REPO

PACKAGE = REPO / "launch"


def imports_of(path: Path, package: str, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != package:
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from launch import console
                found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package and len(parts) > 1:
                    found.add(parts[1])
    return found - {path.stem}


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = {p.stem for p in package_dir.glob("*.py")}
    return {p.stem: imports_of(p, package_dir.name, modules) for p in package_dir.glob("*.py")}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (as a path that ends where it starts), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_one():
    assert cycle({"launcher": {"validate"}, "validate": {"launcher", "machine"}, "machine": set()}) == [
        "launcher", "validate", "launcher"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_launch_has_no_import_circles():
    graph = import_graph(PACKAGE)
    assert {"launcher", "validate", "slurm", "local", "train"} <= set(graph)
    assert cycle(graph) == []


def test_launchers_and_the_validator_meet_only_in_interface_modules():
    graph = import_graph(PACKAGE)
    for launcher in ("local", "slurm"):
        assert "validate" not in graph[launcher] and launcher not in graph["validate"]
    assert graph["launcher"] <= {"machine", "problems", "run_summary"}
    assert graph["problems"] == set()
