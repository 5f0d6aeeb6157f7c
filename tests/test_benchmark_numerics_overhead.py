"""benchmarks/numerics_overhead.py: the arms in turn (off, on, off, on), a row per run with its
provenance, and the comparison row from the runs' own step times. The recipe runs themselves are
stood in for here (a run with the telemetry on is tested in tests/test_numerics_recipe.py)."""

from __future__ import annotations

import pytest

from benchmarks import numerics_overhead
from benchmarks.rows import read_rows
from launch.run_summary import RunSummary


def test_arms_in_turn_and_the_overhead_of_their_means(tmp_path, monkeypatch):
    runs = []

    def fake_run(_overrides, every, run_dir):
        runs.append((every, run_dir.name))
        step_time = {0: [1.0, 1.2], 5: [1.05, 1.21]}[every][len([r for r in runs if r[0] == every]) - 1]
        return RunSummary(run_name="r", experiment="e", a2a="mxfp8", a2a_legs={}, model="m", model_flavor="f",
                          parallelism="single", world_size=1, ep=1, launcher="local", device="cpu",
                          run_dir=str(run_dir), steps=10, target_steps=10, step_time_s=step_time)

    monkeypatch.setattr(numerics_overhead, "run_arm", fake_run)
    row = numerics_overhead.main(["--every", "5", "--repeats", "2", "--out", str(tmp_path), "--", "a2a=mxfp8"])
    assert runs == [(0, "numerics_every_0_0"), (5, "numerics_every_5_0"), (0, "numerics_every_0_1"),
                    (5, "numerics_every_5_1")]
    rows = read_rows(tmp_path)
    assert [r["arm"] for r in rows] == ["off", "on", "off", "on", "on_vs_off"]
    assert all(r["bench"] == "numerics_overhead" and r["overrides"] == ["a2a=mxfp8"] for r in rows)
    assert row == rows[-1] and row["overhead_pct"] == pytest.approx(100 * (1.13 / 1.1 - 1))
    assert rows[1]["step_time_s"] == 1.05 and rows[1]["numerics_every"] == 5


def test_the_arm_with_the_telemetry_must_sample():
    with pytest.raises(SystemExit):
        numerics_overhead.main(["--every", "0"])
