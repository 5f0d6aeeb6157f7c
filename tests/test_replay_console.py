"""The console line of a step that runs again says what grew: the expert capacity, the
activation pool, or both (``launch.titan.metrics.RecipeMetrics.capacity_replay``)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from launch.titan.metrics import RecipeMetrics
from mxfp8_ep.dispatcher.symm import NO_OVERFLOW
from mxfp8_ep.elastic import Overflow


def _line(overflow: Overflow, **transport: str) -> str:
    console = io.StringIO()
    metrics = SimpleNamespace(console=console)
    metrics._say = RecipeMetrics._say.__get__(metrics)
    RecipeMetrics.capacity_replay(metrics, 1, overflow, replays=1, spills=0, **transport)
    return console.getvalue()


def test_a_two_hop_growth_names_the_transport_and_its_node_hop():
    line = _line(Overflow(replay=True, grown=[(160, 256)]), transport="two_hop")
    assert line.startswith("step 1: a two_hop dispatch needed more rows (expert rows, or node-hop rows per node "
                           "pair) than its capacity; capacity grown (160 -> 256 rows), step run again"), line


def test_a_pool_growth_is_named_as_the_pools_not_the_capacitys():
    pool = _line(Overflow(replay=True, pool_grown=[(20, 600)]))
    assert pool.startswith("step 1: the MoE layers kept more routed rows than the activation pool holds; "
                           "pool grown (20 -> 600 rows), step run again"), pool
    assert "capacity grown" not in pool
    both = _line(Overflow(replay=True, grown=[(100, 160)], pool_grown=[(20, 600)]))
    assert "capacity grown (100 -> 160 rows), activation pool grown (20 -> 600 rows), step run again" in both, both
    capacity = _line(Overflow(replay=True, grown=[(100, 160)]))
    assert capacity.startswith("step 1: a symm dispatch needed more expert rows than its capacity; capacity grown "
                               "(100 -> 160 rows), step run again"), capacity
    spill = _line(Overflow(replay=True, spill=True, pool_spilled=[(600, 700)]))
    assert spill.startswith("step 1: more rows were needed than a ceiling allows (the activation pool needed 700 "
                            "rows, ceiling 600); step run again with each dispatch at exactly its rows"), spill
    assert "dispatch needed" not in spill, spill
    spill = _line(Overflow(replay=True, spill=True, spilled=[(288, 528)]))
    assert "(a dispatch needed 528 rows, ceiling 288)" in spill, spill
    # Another rank's overflow: this rank's line says so instead of sizes it does not have, and
    # names the pool where no dispatch passed its capacity on any rank.
    elsewhere = _line(Overflow(replay=True))
    assert "capacity grown (on another rank), step run again" in elsewhere, elsewhere
    pool_elsewhere = _line(Overflow(replay=True, first=NO_OVERFLOW))
    assert pool_elsewhere.startswith("step 1: the MoE layers kept more routed rows than the activation pool holds; "
                                     "pool grown (on another rank), step run again"), pool_elsewhere
    assert "(on another rank)" in _line(Overflow(replay=True, spill=True)), elsewhere
