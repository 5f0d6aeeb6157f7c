"""The launchers and the validator meet in the interface modules (launch/launchers/launcher.py,
launch/config/problems.py), never in each other: a launcher's module does not import the
validator nor the validator a launcher's, so a new launcher is one file the validator never
names. Imports inside functions and under TYPE_CHECKING count (tests/test_import_cycles.py reads
them; it also checks that launch/ has no import circles)."""

from __future__ import annotations

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
