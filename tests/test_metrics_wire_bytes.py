"""The all-to-all bytes the recipe's metrics log (``launch.titan.metrics.RecipeMetrics._wire_bytes``):
each leg's count, ``other`` for a key the library may add, and the part of each leg that crossed
between nodes (the two_hop transport's node hop, ``wire_stats.inter_node_key``) under its own
name, never added to the total a second time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launch.run.run_summary import INTER_NODE, LEG_METRICS, SUMMARY_METRICS, WIRE_PARTS, inter_node_part
from launch.titan.metrics import RecipeMetrics
from mxfp8_ep.config import LEGS
from mxfp8_ep.telemetry import wire_stats


@pytest.fixture(autouse=True)
def fresh_counts():
    wire_stats.reset()
    yield
    wire_stats.reset()


def test_inter_node_bytes_are_their_legs_part_and_logged_apart():
    wire_stats.record("dispatch_fwd", 1000)  # inside a node
    wire_stats.record("dispatch_fwd", 300, inter_node=True)
    wire_stats.record("combine_fwd", 500, inter_node=True)
    wire_stats.record("some_new_leg", 7)
    wire = RecipeMetrics._wire_bytes(SimpleNamespace())
    assert set(wire) == {*WIRE_PARTS, "total"}
    assert (wire["dispatch_fwd"], wire["combine_fwd"], wire["dispatch_bwd"]) == (1300, 500, 0)
    assert wire["other"] == 7
    assert wire[inter_node_part("dispatch_fwd")] == 300 and wire[inter_node_part("combine_fwd")] == 500
    assert wire[INTER_NODE] == 800
    assert wire["total"] == 1300 + 500 + 7
    # each has its own metric, read into the run summary at the end
    assert LEG_METRICS[INTER_NODE] == "a2a/inter_node_bytes_per_step"
    assert LEG_METRICS[inter_node_part("dispatch_fwd")] == "a2a/dispatch_fwd_inter_node_bytes_per_step"
    assert set(LEG_METRICS.values()) <= set(SUMMARY_METRICS)


def test_a_run_inside_one_node_has_no_inter_node_bytes():
    for leg in LEGS:
        wire_stats.record(leg, 100)
    wire = RecipeMetrics._wire_bytes(SimpleNamespace())
    assert wire["total"] == 400 and wire["other"] == 0
    assert all(wire[inter_node_part(leg)] == 0 for leg in LEGS) and wire[INTER_NODE] == 0
