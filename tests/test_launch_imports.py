"""How launch/'s modules meet. The launchers and the validator meet in the interface modules
(launch/launchers/launcher.py, launch/config/problems.py), never in each other: a launcher's
module does not import the validator nor the validator a launcher's, so a new launcher is one
file the validator never names. A subpackage's ``__init__`` imports nothing, so the checks
before launch load only the modules they use. Imports inside functions and under TYPE_CHECKING
count (tests/test_import_cycles.py reads them; it also checks that launch/ has no import
circles and that its subpackages only import downward)."""

from __future__ import annotations

import ast

from tests.hydra_compose import REPO
from tests.test_import_cycles import import_graph

VALIDATE = "launch.preflight.validate"
INTERFACE = "launch.launchers.launcher"
PROBLEMS = "launch.config.problems"


def test_launchers_and_the_validator_meet_only_in_interface_modules():
    graph = import_graph("launch")
    for launcher in ("launch.launchers.local", "launch.launchers.slurm"):
        assert VALIDATE not in graph[launcher] and launcher not in graph[VALIDATE]
    assert {INTERFACE, PROBLEMS} <= graph[VALIDATE]
    assert graph[INTERFACE] <= {"launch.launchers.machine", PROBLEMS, "launch.run.run_summary"}
    assert graph[PROBLEMS] == set()


def test_subpackage_inits_import_nothing():
    """Importing one module of a subpackage runs its ``__init__``: one that imported its modules
    would load them all (torch with them) for a check before launch that needs one."""
    inits = sorted(REPO.joinpath("launch").glob("*/__init__.py"))
    assert len(inits) >= 6
    for init in inits:
        tree = ast.parse(init.read_text())
        imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert imports == [], f"{init.relative_to(REPO)}: {imports}"
        assert ast.get_docstring(tree), f"{init.relative_to(REPO)} says what the subpackage owns"
