"""The console line of a step that runs again says what grew: the expert capacity, the
activation pool, or both (``launch.titan.metrics.RecipeMetrics.capacity_replay``)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from launch.titan.metrics import RecipeMetrics
from mxfp8_ep.elastic import Overflow


def _line(overflow: Overflow) -> str:
    console = io.StringIO()
    RecipeMetrics.capacity_replay(SimpleNamespace(console=console), 1, overflow, replays=1, spills=0)
    return console.getvalue()


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
    assert "activation pool: 700 rows, ceiling 600" in spill, spill
