"""benchmarks/capacity_study.py: a routing telemetry's loads, applied to the target recipe's shape,
through the elastic capacity's rule, as rows."""

from __future__ import annotations

import gzip
import json

from benchmarks.capacity_study import (
    DEFAULTS,
    GRID,
    main,
    read_telemetry,
    sampling_floor,
    simulate,
    target,
)
from benchmarks.rows import read_rows
from launch.config.model_facts import MODELS


def _steps(loads_ep8: list[float]) -> list[dict]:
    """Telemetry lines with these EP=8 loads in the second of two layers (EP 2, 4 even)."""
    return [{"step": i + 1, "layers": [1, 2], "picks": [600, 600],
             "load": {"2": [1.0, 1.0], "4": [1.0, 1.0], "8": [1.0, load]}} for i, load in enumerate(loads_ep8)]


def test_the_target_is_the_16b_recipe():
    t = target()
    assert (t.model, t.gpus, t.tokens, t.activation_checkpoint) == ("deepseek_v3/16B", 8, 8192, "selective")
    assert t.facts == MODELS["deepseek_v3", "16B"]
    # the rows a factor gives: the balanced 8192 x 6 rows times it, a multiple of 8, plus 8 experts' padding
    assert t.rows(8, 1.25) == 61440 + 64 and t.rows(8, None) == t.worst(8) == 8 * 8192 * 6 + 64


def test_the_policy_over_hand_picked_loads():
    """Start 1.25x, headroom 25%, ceiling 2x at EP=8: 1.4x grows (to 1.4 x 1.25 = 1.75x), 1.3x
    fits, 1.8x grows to the ceiling, 2.5x spills, 1.2x fits."""
    t = target()
    sim = simulate([1.0, 1.4, 1.3, 1.8, 2.5, 1.2], [1, 2, 3, 4, 5, 6], t, 8, 1.25, 0.25, 2.0)
    assert (sim["replays"], sim["last_replay_step"], sim["spills"], sim["last_spill_step"]) == (2, 4, 1, 5)
    assert sim["start_rows"] == t.rows(8, 1.25)
    assert sim["end_rows"] == sim["peak_rows"] == t.rows(8, 2.0) and sim["end_factor"] == 2.0
    no_ceiling = simulate([1.0, 1.4, 1.3, 1.8, 2.5, 1.2], [1, 2, 3, 4, 5, 6], t, 8, 1.25, 0.25, None)
    assert no_ceiling["spills"] == 0 and no_ceiling["replays"] == 3 and no_ceiling["end_factor"] > 2.5


def test_a_uniform_routers_loads_shrink_with_the_tokens_counted():
    small, large = (sampling_floor(picks, 6, 64, 2, 8, steps=20) for picks in (600, 60_000))
    assert small > large > 1.0 and large < 1.05


def test_rows_from_telemetry_and_again_from_the_saved_copy(tmp_path):
    path = tmp_path / "routing.jsonl"
    lines = _steps([1.1, 1.6, 1.3]) + [_steps([1.1, 1.9])[1]]  # step 2 again (a resumed run): the last wins
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [max(s["load"]["8"]) for s in read_telemetry(path)] == [1.1, 1.9, 1.3]

    saved = tmp_path / "telemetry" / "study.routing.jsonl.gz"
    main([str(path), "--out", str(tmp_path / "rows"), "--save-telemetry", str(saved), "--source", "python x"])
    assert [json.loads(line) for line in gzip.decompress(saved.read_bytes()).decode().splitlines()] == \
        read_telemetry(path)
    rows = read_rows(tmp_path / "rows")
    assert len(rows) == 3 * len(GRID) and {r["bench"] for r in rows} == {"capacity_study"}
    (default,) = [r for r in rows if r["defaults"] and r["ep"] == 8]
    assert (default["capacity_factor"], default["headroom"], default["capacity_ceiling"]) == DEFAULTS
    assert default["max_load"] == 1.9 and default["max_load_step"] == 2 and default["steps"] == 3
    assert default["max_load_second_half"] == 1.9  # steps 2 and 3
    assert default["gib_nccl"] < default["gib_start"] <= default["gib_ceiling"]
    assert default["telemetry_source"] == "python x" and default["study_picks_per_layer"] == 600
    assert all(r["replays"] == 0 and r["spills"] == 0 for r in rows if r["ep"] != 8 and r["capacity_factor"] >= 1.0)

    main([str(saved), "--out", str(tmp_path / "again")])
    strip = ("date", "command", "telemetry", "telemetry_source")
    assert [{k: v for k, v in r.items() if k not in strip} for r in read_rows(tmp_path / "again")] == \
        [{k: v for k, v in r.items() if k not in strip} for r in rows]
