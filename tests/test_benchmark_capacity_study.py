"""benchmarks/capacity_study.py: a routing telemetry's loads, applied to the target recipe's shape,
through the activation pool's and the elastic capacity's rules, as rows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.capacity_study import (
    DEFAULTS,
    GRID,
    MIN_VERDICT_STEPS,
    Policy,
    StepLoads,
    extrapolation,
    main,
    read_telemetry,
    sampling_floor,
    simulate,
    source_of,
    step_loads,
    target,
)
from benchmarks.rows import read_rows
from launch.config.model_facts import MODELS


def _steps(loads_ep8: list[float]) -> list[dict]:
    """Telemetry lines of two layers of 64 experts, 6144 picks each: the first even, the
    second with ``load`` times the balanced rows on EP=8's first rank (its 8 experts), the rest
    spread evenly over the others."""
    lines = []
    for i, load in enumerate(loads_ep8):
        busy = round(768 * load)
        rest = (6144 - busy) // 56
        second = [busy // 8] * 8 + [rest] * 56
        second[8] += 6144 - sum(second)
        lines.append({"step": i + 1, "layers": [1, 2], "picks": [6144, 6144],
                      "load": {"2": [1.0, 1.0], "4": [1.0, 1.0], "8": [1.0, load]}, "counts": [[96] * 64, second]})
    return lines


def _run_dir(tmp_path, model: str, steps: int):
    """A run folder as a training run leaves it: its routing.jsonl and train_config.yaml."""
    run = tmp_path / model
    run.mkdir()
    (run / "routing.jsonl").write_text("".join(json.dumps(line) + "\n" for line in _steps([1.25] * steps)))
    (run / "train_config.yaml").write_text(f"model:\n  name: {model}\n")
    return run / "routing.jsonl"


@pytest.mark.parametrize("model,why", [
    ("dsv3_debugmodel", ["50 steps, fewer than the 1,000 a verdict takes",
                         "its 2 MoE layers and 64 experts are not model=dsv3_debugmodel's"]),
    ("tiny_llama4", ["50 steps, fewer than the 1,000", "model=tiny_llama4 is llama4, not the target's family "
                     "(deepseek_v3: deepseek_v3/16B)"]),
])
def test_a_verdict_from_a_short_run_or_another_model_is_refused_naming_the_input(tmp_path, capsys, model, why):
    """A 50-step run of a debug model (or of a Llama4): the study says what its input is, then
    refuses the verdict on DeepSeek-V3 16B at EP=8 before writing any row, naming --extrapolate."""
    path = _run_dir(tmp_path, model, 50)
    with pytest.raises(SystemExit) as e:
        main([str(path), "--out", str(tmp_path / "rows")])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    facts = MODELS[("deepseek_v3", "debugmodel") if model == "dsv3_debugmodel" else ("llama4", "tiny")]
    assert out.startswith(f"input: 50 steps (1-50) of model={model} (") and f"top-{facts.top_k}" in out
    assert str(path.parent / "train_config.yaml") in out
    assert all(w in err for w in why) and "--extrapolate" in err and MIN_VERDICT_STEPS == 1000
    assert not (tmp_path / "rows").exists()
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    assert f"refuses a verdict on\nthat target from fewer than {MIN_VERDICT_STEPS:,} steps" in usage


def test_a_long_run_of_the_targets_family_with_its_own_layers_is_no_extrapolation():
    src = source_of(Path("routing.jsonl"), _steps([1.0] * MIN_VERDICT_STEPS), "routing_study_full_dsv3")
    assert src.top_k == 6 and extrapolation(src, target()) == [
        "its 2 MoE layers and 64 experts are not model=routing_study_full_dsv3's (26, 64)"]
    shaped = [{**s, "layers": list(range(1, 27)), "counts": s["counts"] * 13} for s in _steps([1.0] * 1000)]
    assert extrapolation(source_of(Path("routing.jsonl"), shaped, "routing_study_full_dsv3"), target()) == []
    assert extrapolation(source_of(Path("routing.jsonl"), shaped[:999], "routing_study_full_dsv3"), target()) == [
        "999 steps, fewer than the 1,000 a verdict takes (the capacity grows and the routing drifts over the "
        "first hundreds)"]


def test_the_target_is_the_16b_recipe():
    t = target()
    assert (t.model, t.gpus, t.tokens, t.activation_checkpoint) == ("deepseek_v3/16B", 8, 8192, "selective")
    assert t.facts == MODELS["deepseek_v3", "16B"]
    # the rows a factor gives: the balanced 8192 x 6 rows times it, a multiple of 8, plus 8 experts' padding
    assert t.rows(8, 1.25) == 61440 + 64 and t.rows(8, None) == t.worst(8) == 8 * 8192 * 6 + 64


def _loads(layer_loads: list[float], rank_sums: list[float]) -> list[StepLoads]:
    return [StepLoads(i + 1, (load,), total, False) for i, (load, total) in enumerate(zip(layer_loads, rank_sums))]


def test_the_policy_over_hand_picked_loads():
    """The capacity starts at 1.25x, grows by 25% up to a ceiling of 2x at EP=8: 1.4x grows it
    (to 1.75x), 1.3x fits, 1.8x grows it to the ceiling, 2.5x spills, 1.2x fits. The pool starts
    at 1.1x, grows by 10% up to 1.3x: 1.15x at step 3 grows it (to 1.265x), 1.4x at step 6
    spills. A step rerun for both counts once; the first step reruns in any case (the pool learns
    its depth there)."""
    t = target()
    policy = Policy(1.25, 2.0, 1.1, 1.3)
    sim = simulate(_loads([1.0, 1.4, 1.3, 1.8, 2.5, 1.2], [1.0, 1.05, 1.15, 1.0, 1.1, 1.4]), t, 8, policy,
                   headroom=0.25, pool_headroom=0.1)
    assert (sim["replays"], sim["spills"], sim["pool_spills"], sim["reruns"]) == (4, 2, 1, 6)
    assert sim["reruns_per_1000"] == 1000.0 and sim["last_rerun_step"] == 6
    assert sim["start_rows"] == t.rows(8, 1.25) and sim["pool_start_rows"] == t.pool(8, 1.1)
    assert sim["end_rows"] == sim["peak_rows"] == t.rows(8, 2.0) and sim["end_factor"] == 2.0
    assert sim["pool_end_rows"] == t.pool(8, 1.3) and sim["pool_end_factor"] == 1.3
    both = simulate(_loads([1.4], [1.2]), t, 8, policy, headroom=0.25, pool_headroom=0.1)
    assert (both["replays"], both["reruns"]) == (1, 1)
    no_ceiling = simulate(_loads([1.0, 1.4, 1.3, 1.8, 2.5, 1.2], [1.0] * 6), t, 8, Policy(1.25, None, 1.1, 1.3))
    assert no_ceiling["spills"] == 0 and no_ceiling["replays"] == 4 and no_ceiling["end_factor"] > 2.5


def test_a_ranks_sum_over_the_layers_from_the_counts():
    """EP=2, two layers of four experts: rank 0 gets 3/4 of layer 1 and 1/4 of layer 2, so each
    layer's busiest load is 1.5 and the busiest rank's sum over the layers is balanced; without
    counts the mean of the layers' busiest loads bounds it."""
    line = {"step": 7, "layers": [1, 2], "picks": [8, 8], "load": {"2": [1.5, 1.5]},
            "counts": [[3, 3, 1, 1], [1, 1, 3, 3]]}
    (loads,) = step_loads([line], 2)
    assert loads == StepLoads(7, (1.5, 1.5), 1.0, False) and loads.layer_load == 1.5
    (bound,) = step_loads([{k: v for k, v in line.items() if k != "counts"}], 2)
    assert bound == StepLoads(7, (1.5, 1.5), 1.5, True)


def test_a_uniform_routers_loads_shrink_with_the_tokens_counted():
    small, large = (sampling_floor(picks, 6, 64, 2, 8, steps=20) for picks in (600, 60_000))
    assert small > large > 1.0 and large < 1.05


def test_rows_from_telemetry_and_again_from_the_saved_copy(tmp_path, capsys):
    path = tmp_path / "routing.jsonl"
    lines = _steps([1.125, 1.625, 1.25]) + [_steps([1.125, 1.875])[1]]  # step 2 again (resumed): the last wins
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [max(s["load"]["8"]) for s in read_telemetry(path)] == [1.125, 1.875, 1.25]

    saved = tmp_path / "telemetry" / "study.routing.jsonl.gz"
    main([str(path), "--out", str(tmp_path / "rows"), "--save-telemetry", str(saved), "--source", "python x",
          "--extrapolate"])
    assert [json.loads(line) for line in gzip.decompress(saved.read_bytes()).decode().splitlines()] == \
        read_telemetry(path)
    rows = read_rows(tmp_path / "rows")
    policies = [r for r in rows if r["kind"] == "policy"]
    assert len(policies) == 3 * len(GRID) and {r["bench"] for r in rows} == {"capacity_study"}
    routing = {r["ep"]: r for r in rows if r["kind"] == "routing"}
    assert sorted(routing) == [2, 4, 8] and not routing[8]["rank_sum_bound"]
    assert routing[8]["max_layer_load"] == 1.875 and routing[8]["max_layer_load_step"] == 2
    # rank 0's sum over the two layers: (1 + 1.875) / 2
    assert routing[8]["max_rank_sum"] == 1.4375 and routing[8]["max_rank_sum_step"] == 2
    (default,) = [r for r in policies if r["defaults"] and r["ep"] == 8]
    assert (default["capacity_factor"], default["capacity_ceiling"], default["pool_factor"],
            default["pool_ceiling"]) == (DEFAULTS.capacity_factor, DEFAULTS.capacity_ceiling, DEFAULTS.pool_factor,
                                         DEFAULTS.pool_ceiling)
    assert default["steps"] == 3 and default["telemetry_source"] == "python x"
    assert default["study_picks_per_layer"] == 6144 and default["study_moe_layers"] == 2
    assert default["gib_nccl"] < default["gib_nccl_routed"] and default["gib_start"] <= default["gib_ceiling"]
    assert default["vs_nccl_routed"] == round(default["gib_ceiling"] / default["gib_nccl_routed"], 4)
    # EP=2: rank 0 holds 1.125x the balanced rows of layer 2, below every policy's start: only
    # the first step's rerun (the pool learns its depth)
    assert all(r["reruns"] == 1 for r in policies if r["ep"] == 2)
    out = capsys.readouterr().out
    assert "EP=8 defaults: " in out and "EP=8 target (<= 10 reruns per 1,000 steps" in out
    assert out.startswith("input: 3 steps (1-3) of an unknown model (2 MoE layers, 64 experts, top-k unknown")
    assert "extrapolated (--extrapolate): 3 steps, fewer than the 1,000 a verdict takes" in out

    main([str(saved), "--out", str(tmp_path / "again"), "--extrapolate"])
    strip = ("date", "command", "telemetry", "telemetry_source")
    assert [{k: v for k, v in r.items() if k not in strip} for r in read_rows(tmp_path / "again")] == \
        [{k: v for k, v in r.items() if k not in strip} for r in rows]
